//! The group's verification: every check a round's answers go through (code residuals,
//! projected checks, the update probe's fit, late answers, backward rounds by Freivalds' check),
//! and what follows a failed one.

use super::*;

impl<T: Transport> CodedGroup<T> {
    /// Checks each answer that came after its round was decoded against that decode: one
    /// that disagrees with k answers the round's check passed is the wrong one, caught as in
    /// the round.
    pub(super) fn check_late(&mut self) {
        let late = self.transport.late_answers();
        if late.is_empty() {
            return;
        }
        let recent = std::mem::take(&mut self.recent);
        self.check_late_against(&recent, late);
        self.recent = recent;
    }

    pub(super) fn check_late_against(
        &mut self,
        recent: &VecDeque<Recent>,
        late: Vec<(u64, usize, Vec<u8>)>,
    ) {
        let m = self.generator.sub_blocks();
        for (round, node, bytes) in late {
            if let Some(e) = self.embedding.as_mut().filter(|e| e.round == round) {
                if e.late.is_none() && e.parts.iter().all(|(n, _)| *n != node) {
                    e.late = Some((node, bytes));
                }
                continue;
            }
            let Some(r) = recent.iter().find(|r| r.round == round) else {
                continue;
            };
            if !self.members.contains(&node) || r.parts.iter().any(|(n, _)| *n == node) {
                continue;
            }
            let values = match parse_answer(node, &bytes, m * r.c) {
                Ok(values) => values,
                Err(e) => {
                    tracing::warn!(node, error = %e, "dropping a member whose late answer is unusable");
                    self.drop_member(node);
                    continue;
                }
            };
            let answer = (node, values);
            let set: Vec<&(usize, Vec<f32>)> =
                r.parts.iter().chain(std::iter::once(&answer)).collect();
            let checked = match self.consistent(&set, r.c) {
                Ok(checked) => checked,
                Err(e) => {
                    tracing::warn!(node, error = %e, "a late answer could not be checked");
                    continue;
                }
            };
            self.stats.late_checked += 1;
            if let Err((residual, threshold)) = checked {
                self.convict(Caught {
                    node,
                    step: format!("{} (an answer that came late)", r.what),
                    residual,
                    threshold,
                    witnesses: r.parts.iter().map(|(n, _)| *n).collect(),
                    missing_update: None,
                });
            }
        }
    }

    /// Whether this pass's embedding round is decoded from k answers and checked before the
    /// LM head ([`Unchecked`]): where product rounds are checked by projection, so the check
    /// row answers nothing else in a pass, no update probe needs the round's residuals, a
    /// member beyond k can answer, and the leader asks alone (a hop group's members run every
    /// round in step). A lie then fails the pass once (the liar is dropped
    /// where it can be located), and the leader runs it again.
    pub(super) fn defers_embedding_check(&self) -> bool {
        self.transport.asks_alone()
            && self.sketch.is_some()
            && self.probe.is_none()
            && self.members.len() > self.generator.k()
    }

    /// The embedding round `request` (`c` columns) decoded from its first k answers; the
    /// answer of a member beyond them checks it later ([`Self::check_embedding`]).
    pub(super) async fn embed_unchecked(
        &mut self,
        request: &StepRequest,
        c: usize,
    ) -> Result<Vec<f32>, CodedError> {
        let k = self.generator.k();
        let bytes = protocol::encode(request)?;
        self.transport.label("embedding");
        let mut parts = Parts::with_capacity(k + 1);
        // What comes beside the first k (a transport that answers every member at once) is
        // kept as the answer that checks them.
        self.surplus = Some(None);
        let collected = self.collect(&bytes, c, &mut parts, k, None).await;
        let late = self.surplus.take().flatten();
        collected?;
        self.stats.rounds += 1;
        if parts.len() < k {
            return Err(CodedError::Member {
                node: usize::MAX,
                reason: format!("only {} of k = {k} members answered", parts.len()),
            });
        }
        let refs: Vec<(usize, &[f32])> = parts.iter().map(|(n, v)| (*n, v.as_slice())).collect();
        let (out, _, _) = self.decode_and_predict(&refs, c)?;
        // A transport that numbers no rounds has no late answers: what came beside is all.
        self.embedding = Some(Unchecked {
            round: self.transport.last_round().unwrap_or(u64::MAX),
            parts,
            c,
            bytes,
            late,
        });
        self.check_late();
        Ok(out)
    }

    /// Checks the pass's embedding round decoded unchecked, if one waits, with the answer
    /// that came for it since (or asked for now). Answers that disagree fail the pass, with the
    /// member that lied located and dropped where enough members answer: the pass runs again.
    pub(super) async fn check_embedding(&mut self) -> Result<(), CodedError> {
        if self.embedding.is_some() {
            // Routes an answer that came for it since.
            self.check_late();
        }
        let Some(Unchecked {
            mut parts,
            c,
            bytes,
            late,
            ..
        }) = self.embedding.take()
        else {
            return Ok(());
        };
        let k = self.generator.k();
        let m = self.generator.sub_blocks();
        match late.map(|(node, answer)| (node, parse_answer(node, &answer, m * c))) {
            Some((node, Ok(values))) if self.members.contains(&node) => parts.push((node, values)),
            Some((node, Err(e))) => {
                tracing::warn!(node, error = %e, "dropping a member whose late answer is unusable");
                self.drop_member(node);
            }
            _ => {}
        }
        if parts.len() == k {
            self.transport.label("embedding");
            self.collect(&bytes, c, &mut parts, k + 1, None).await?;
        }
        if parts.len() == k {
            self.stats.unverified_rounds += 1;
            return Ok(());
        }
        let all: Vec<&(usize, Vec<f32>)> = parts.iter().collect();
        if self.consistent(&all, c)?.is_ok() {
            self.stats.verified_rounds += 1;
            return Ok(());
        }
        // Locates and drops the member that lied (or says none can be told apart).
        self.decode_checked(&mut parts, c, &bytes, "embedding")
            .await?;
        Err(CodedError::Verification(
            "the embedding's answers disagreed with the code; the pass runs again".into(),
        ))
    }

    /// Records a member caught answering against the code, with the evidence, and drops it.
    pub(super) fn convict(&mut self, caught: Caught) {
        tracing::warn!(node = caught.node, "{caught}");
        self.drop_member(caught.node);
        self.stats.caught.push(caught);
    }

    /// Leaves `node` out of the group from now on, counted.
    pub(super) fn drop_member(&mut self, node: usize) {
        self.members.retain(|&n| n != node);
        self.stats.members_dropped += 1;
    }

    /// The residuals of the answers beyond the first k (in order) against the decode of the
    /// first k, one after another.
    pub(super) fn residuals(
        &mut self,
        parts: &[(usize, &[f32])],
        c: usize,
    ) -> Result<Vec<f32>, CodedError> {
        let k = self.generator.k();
        let (_, _, predicted) = self.decode_and_predict(parts, c)?;
        Ok(parts
            .iter()
            .skip(k)
            .zip(&predicted)
            .flat_map(|((_, actual), p)| actual.iter().zip(p).map(|(a, p)| a - p))
            .collect())
    }

    /// Fits a checked round's residuals against the learning updates under test; when a member
    /// is convicted of missing one, it is recorded, dropped, and the round is decoded again
    /// from the others (returned).
    pub(super) fn probe_round(
        &mut self,
        stage: Stage,
        x: &[f32],
        t: usize,
        parts: &mut Parts,
        c: usize,
        what: &str,
    ) -> Result<Option<Vec<f32>>, CodedError> {
        let Some(mut probe) = self.probe.take() else {
            return Ok(None);
        };
        let result = self.fit_round(&mut probe, stage, x, t, parts, c);
        let fits: Vec<_> = (0..probe.len()).flat_map(|u| probe.fits(u)).collect();
        self.probe = Some(probe);
        result?;
        let rows: Vec<usize> = parts.iter().map(|(n, _)| *n).collect();
        let convicted = fits
            .iter()
            .filter(|f| rows.contains(&f.row) && f.convicts())
            .max_by(|a, b| a.sigmas.abs().total_cmp(&b.sigmas.abs()));
        for f in fits.iter().filter(|f| !f.convicts()) {
            self.stats.max_probe_sigmas = self.stats.max_probe_sigmas.max(f.sigmas.abs());
        }
        let Some(fit) = convicted.copied() else {
            return Ok(None);
        };
        let Some(i) = parts.iter().position(|(n, _)| *n == fit.row) else {
            return Ok(None);
        };
        parts.remove(i);
        let rest: Vec<&(usize, Vec<f32>)> = parts.iter().collect();
        let out = match self.consistent(&rest, c)? {
            Ok((out, _)) => out,
            Err((worst, threshold)) => {
                self.stats.unlocated += 1;
                return Err(CodedError::Verification(format!(
                    "{what}: without row {} (missing update {:016x}) the others disagree (residual {worst:.2e} > {threshold:.2e})",
                    fit.row, fit.id
                )));
            }
        };
        self.convict(Caught {
            node: fit.row,
            step: what.to_string(),
            residual: fit.sigmas.abs(),
            threshold: crate::coded::probe::PROBE_SIGMAS,
            witnesses: parts.iter().map(|(n, _)| *n).collect(),
            missing_update: Some((fit.id, fit.share)),
        });
        Ok(Some(out))
    }

    /// Adds one round's evidence to every update still under test.
    pub(super) fn fit_round(
        &mut self,
        probe: &mut UpdateProbe,
        stage: Stage,
        x: &[f32],
        t: usize,
        parts: &Parts,
        c: usize,
    ) -> Result<(), CodedError> {
        let m = self.generator.sub_blocks();
        let rows: Vec<usize> = parts.iter().map(|(n, _)| *n).collect();
        let open = probe.open(&rows);
        if open.is_empty() {
            return Ok(());
        }
        let refs: Vec<(usize, &[f32])> = parts.iter().map(|(n, v)| (*n, v.as_slice())).collect();
        let res = self.residuals(&refs, c)?;
        // The round's noise variance per value, floored at a fraction of f32's resolution of
        // the answers so an exactly consistent round does not claim infinite precision.
        let scale = parts
            .iter()
            .flat_map(|(_, v)| v.iter())
            .fold(0.0f64, |a, &v| a.max(v.abs() as f64));
        let floor = (1e-3 * f32::EPSILON as f64 * scale).powi(2);
        let var = (res.iter().map(|&r| r as f64 * r as f64).sum::<f64>() / res.len().max(1) as f64)
            .max(floor)
            .max(f64::MIN_POSITIVE);
        let zeros = vec![0.0f32; m * c];
        let mut counted = false;
        for u in open {
            let Some(effect) = probe.effect(u, &self.cfg, &self.generator, stage, x, t) else {
                continue;
            };
            let mut sigs = Vec::with_capacity(rows.len());
            let mut e = vec![0.0f32; m * c];
            for (i, &row) in rows.iter().enumerate() {
                self.generator.predict_part(row, &effect, &mut e)?;
                let only: Vec<(usize, &[f32])> = rows
                    .iter()
                    .enumerate()
                    .map(|(j, &n)| {
                        (
                            n,
                            if j == i {
                                e.as_slice()
                            } else {
                                zeros.as_slice()
                            },
                        )
                    })
                    .collect();
                let mut s = self.residuals(&only, c)?;
                s.iter_mut().for_each(|v| *v = -*v);
                sigs.push((row, s));
            }
            probe.add(u, &res, &sigs, var);
            counted = true;
        }
        self.stats.probed_rounds += u64::from(counted);
        Ok(())
    }

    /// Decodes the first k of `parts` (in arrival order) and checks the rest against them:
    /// the decoded blocks and the threshold of that decode, or the largest residual and the
    /// threshold when a check fails.
    pub(super) fn consistent(
        &mut self,
        parts: &[&(usize, Vec<f32>)],
        c: usize,
    ) -> Result<Checked, CodedError> {
        let k = self.generator.k();
        let refs: Vec<(usize, &[f32])> = parts.iter().map(|(n, v)| (*n, v.as_slice())).collect();
        let (out, kappa, predicted) = self.decode_and_predict(&refs, c)?;
        let threshold = self.verify.threshold(kappa);
        if predicted.is_empty() {
            // No answer beyond the k decoded to check (the scale below would go unused).
            return Ok(Ok((out, threshold)));
        }
        let floor = largest(&out);
        let worst = refs
            .iter()
            .skip(k)
            .zip(&predicted)
            .map(|((_, actual), p)| residual(actual, p, floor))
            .fold(0.0f64, f64::max);
        if worst > threshold || worst.is_nan() {
            return Ok(Err((worst, threshold)));
        }
        self.stats.max_pass_ratio = self.stats.max_pass_ratio.max(worst / threshold);
        Ok(Ok((out, threshold)))
    }

    /// Decodes the first k of `parts` (in order; decoded sorted by row) and predicts each later
    /// answer from them: the decoded blocks, the decoding's condition number, the predictions.
    pub(super) fn decode_and_predict(
        &mut self,
        parts: &[(usize, &[f32])],
        c: usize,
    ) -> Result<Predicted, CodedError> {
        let (k, m) = (self.generator.k(), self.generator.sub_blocks());
        let mut decode: Vec<(usize, &[f32])> = parts.iter().take(k).copied().collect();
        decode.sort_by_key(|(n, _)| *n);
        let rows: Vec<usize> = decode.iter().map(|(n, _)| *n).collect();
        let refs: Vec<&[f32]> = decode.iter().map(|(_, v)| *v).collect();
        let mut out = vec![0.0f32; k * m * c];
        let decoder = self.decoder_for(&rows)?;
        decoder.decode(&refs, &mut out)?;
        let kappa = decoder.condition_number();
        let predicted = parts
            .iter()
            .skip(k)
            .map(|(node, _)| {
                let mut p = vec![0.0f32; m * c];
                self.generator.predict_part(*node, &out, &mut p).map(|()| p)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((out, kappa, predicted))
    }

    /// The decoded blocks of a round, checked: a member whose answer disagrees is located
    /// (leave-one-out over k + 2 answers, asking one more member when only k + 1 came),
    /// reported in [`ExecStats::caught`], dropped from the group, and the round is decoded from
    /// the members that agree.
    pub(super) async fn decode_checked(
        &mut self,
        parts: &mut Parts,
        c: usize,
        bytes: &[u8],
        what: &str,
    ) -> Result<Vec<f32>, CodedError> {
        let k = self.generator.k();
        if parts.len() > k {
            self.stats.verified_rounds += 1;
        } else {
            self.stats.unverified_rounds += u64::from(self.verify.extra > 0);
        }
        let all: Vec<&(usize, Vec<f32>)> = parts.iter().collect();
        let (worst, threshold) = match self.consistent(&all, c)? {
            // With k answers there is nothing to check: this is the plain decode.
            Ok((out, _)) => return Ok(out),
            Err(r) => r,
        };
        tracing::warn!(
            what,
            residual = worst,
            threshold,
            "answers disagree with the code; locating the member"
        );
        // Leave-one-out needs k + 2 answers: ask for one more if only k + 1 came.
        self.collect(bytes, c, parts, k + 2, None).await?;
        if parts.len() < k + 2 {
            self.stats.unlocated += 1;
            return Err(CodedError::Verification(format!(
                "{what}: answers disagree (residual {worst:.2e} > {threshold:.2e}) and no further member can tell which is wrong"
            )));
        }
        let rest_of = |i: usize| -> Vec<&(usize, Vec<f32>)> {
            parts
                .iter()
                .enumerate()
                .filter_map(|(j, p)| (j != i).then_some(p))
                .collect()
        };
        let mut found = Vec::new();
        for i in 0..parts.len() {
            if let Ok(agreed) = self.consistent(&rest_of(i), c)? {
                found.push((i, agreed));
            }
        }
        if found.len() > 1 {
            // A set that still holds the wrong member can pass when that member weighs little
            // in the one prediction made: such sets are told apart by checking each of their
            // members in turn against the decode of the others (it fails where the wrong
            // member is the one checked). Only then, so a round located at once is located as
            // before.
            let mut kept = Vec::new();
            for (i, agreed) in found {
                let mut rest = rest_of(i);
                let mut every = true;
                for _ in 1..rest.len() {
                    rest.rotate_left(1);
                    if self.consistent(&rest, c)?.is_err() {
                        every = false;
                        break;
                    }
                }
                if every {
                    kept.push((i, agreed));
                }
            }
            found = kept;
        }
        let [(i, (out, threshold))] = <[_; 1]>::try_from(found).map_err(|found| {
            self.stats.unlocated += 1;
            CodedError::Verification(format!(
                "{what}: answers disagree (residual {worst:.2e} > {threshold:.2e}) and {} members are suspect",
                if found.is_empty() { "several".to_string() } else { found.len().to_string() }
            ))
        })?;
        let (node, values) = parts.remove(i);
        // The evidence: its residual against the decode of the members that agree, on the
        // check's own scale (at least the decoded values', as `consistent` measures).
        let mut predicted = vec![0.0f32; values.len()];
        self.generator.predict_part(node, &out, &mut predicted)?;
        let own = residual(&values, &predicted, largest(&out));
        self.convict(Caught {
            node,
            step: what.to_string(),
            residual: own,
            threshold,
            witnesses: parts.iter().map(|(n, _)| *n).collect(),
            missing_update: None,
        });
        Ok(out)
    }

    /// The check row that checks a forward round of `stage` by projection, with its
    /// projections for the stage fetched; `None` when the round is checked by answers: no
    /// check row, too few other members, or an update probe still needing the residuals of
    /// the rows that take part. A check row that cannot give its projections is dropped.
    pub(super) async fn projecting(&mut self, stage: Stage) -> Result<Option<usize>, CodedError> {
        let k = self.generator.k();
        let Some(row) = self.sketch.as_ref().map(|s| s.row) else {
            return Ok(None);
        };
        if !self.members.contains(&row) {
            self.sketch = None;
            return Ok(None);
        }
        // The rows that take part in a projected round: those decoded last and the check row
        // (a spare that never answers would keep the probe open for ever).
        let mut taking_part: Vec<usize> = self
            .decoders
            .first()
            .map(|d| d.nodes().to_vec())
            .unwrap_or_default();
        taking_part.push(row);
        if self.members.len() <= k
            || self
                .probe
                .as_ref()
                .is_some_and(|p| !p.open(&taking_part).is_empty())
        {
            return Ok(None);
        }
        if self
            .sketch
            .as_ref()
            .is_some_and(|s| s.stages.contains_key(&stage))
        {
            return Ok(Some(row));
        }
        let (inp, lens) = self.stage_layout(stage);
        let per_sub: usize = lens.iter().sum();
        let m = self.generator.sub_blocks();
        let directions: Vec<Vec<f32>> = (0..PROJECTIONS)
            .map(|_| random_input(&mut self.checks, m * per_sub))
            .collect();
        // A transpose request's layout: [sub-block][matrix][direction][row].
        let mut u = Vec::with_capacity(PROJECTIONS * m * per_sub);
        for sub in 0..m {
            let mut at = sub * per_sub;
            for &l in &lens {
                for d in &directions {
                    u.extend_from_slice(&d[at..at + l]);
                }
                at += l;
            }
        }
        let request = protocol::encode(&StepRequest::MatmulT {
            stage,
            t: PROJECTIONS as u32,
            u,
        })?;
        self.transport.label(&format!("{stage:?} projection"));
        self.stats.bytes_sent += request.len() as u64;
        self.stats.member_requests += 1;
        self.stats.rounds += 1;
        let started = Instant::now();
        let answer = self.transport.round_each(vec![(row, request)]).await;
        self.stats.member_time += started.elapsed();
        let products = answer.map_err(CodedError::Transport).and_then(|answers| {
            let (_, bytes) =
                answers
                    .iter()
                    .find(|(n, _)| *n == row)
                    .ok_or_else(|| CodedError::Member {
                        node: row,
                        reason: "gave no projection".into(),
                    })?;
            self.stats.bytes_received += bytes.len() as u64;
            let w = parse_answer(row, bytes, PROJECTIONS * inp)?;
            match w.iter().all(|v| v.is_finite()) {
                true => Ok(w),
                false => Err(CodedError::Member {
                    node: row,
                    reason: "gave a projection that is not finite".into(),
                }),
            }
        });
        match products {
            Ok(w) => {
                let products: Vec<Vec<f32>> =
                    w.chunks_exact(inp.max(1)).map(<[f32]>::to_vec).collect();
                let norms = products
                    .iter()
                    .zip(&directions)
                    .map(|(w, d)| pair_norms(w, d))
                    .collect();
                if let Some(sketch) = self.sketch.as_mut() {
                    sketch.stages.insert(
                        stage,
                        Arc::new(Projection {
                            directions,
                            products,
                            norms,
                        }),
                    );
                }
                Ok(Some(row))
            }
            Err(e) => {
                tracing::warn!(node = row, error = %e, "dropping a check row that gave no usable projection");
                self.drop_member(row);
                self.sketch = None;
                Ok(None)
            }
        }
    }

    /// Decodes a round of k answers and checks it by projection: for each direction `ρ` and
    /// token τ, `ρ·ŷ_p[τ]` (the check row's answer predicted from the decode) must match
    /// `w·x[τ]` ([`transpose_residual`] within [`VerifyConfig::backward_threshold`]). When it
    /// does not, the check row is asked for its answer and the round is checked by answers
    /// ([`Self::decode_checked`]); if every answer then agrees, the check row's projection was
    /// wrong, and it is caught.
    #[allow(clippy::too_many_arguments, reason = "one round's whole context")]
    pub(super) async fn decode_projected(
        &mut self,
        row: usize,
        stage: Stage,
        x: &[f32],
        t: usize,
        parts: &mut Parts,
        c: usize,
        bytes: &[u8],
        what: &str,
    ) -> Result<Vec<f32>, CodedError> {
        // Shared, not borrowed: the decode below needs the group mutably.
        let Some(projection) = self
            .sketch
            .as_ref()
            .and_then(|s| s.stages.get(&stage))
            .cloned()
        else {
            return self.decode_checked(parts, c, bytes, what).await;
        };
        let Projection {
            directions,
            products,
            norms,
        } = &*projection;
        let m = self.generator.sub_blocks();
        let refs: Vec<(usize, &[f32])> = parts.iter().map(|(n, v)| (*n, v.as_slice())).collect();
        let (out, kappa, _) = self.decode_and_predict(&refs, c)?;
        let mut predicted = vec![0.0f32; m * c];
        self.generator.predict_part(row, &out, &mut predicted)?;
        let (inp, lens) = self.stage_layout(stage);
        let threshold = self
            .verify
            .backward_threshold(kappa, m * lens.iter().sum::<usize>(), inp);
        let mut worst = 0.0f64;
        // A non-finite answer makes every dot product NaN, which no comparison would flag.
        if !predicted.iter().all(|v| v.is_finite()) {
            worst = f64::INFINITY;
        }
        let pairs: Vec<(&[f32], &[f32])> = products
            .iter()
            .zip(directions)
            .map(|(w, d)| (w.as_slice(), d.as_slice()))
            .collect();
        worst = worst.max(transpose_residuals(&pairs, norms, x, &predicted, &lens, t)?);
        if worst <= threshold {
            self.stats.verified_rounds += 1;
            self.stats.projected_rounds += 1;
            self.stats.max_projected_ratio = self.stats.max_projected_ratio.max(worst / threshold);
            return Ok(out);
        }
        tracing::warn!(
            what,
            residual = worst,
            threshold,
            "answers disagree with the check row's projection; asking it for its answer"
        );
        let caught = self.stats.caught.len();
        let k = self.generator.k();
        self.collect(bytes, c, parts, k + 1, None).await?;
        let out = self.decode_checked(parts, c, bytes, what).await?;
        let answered = parts.iter().any(|(n, _)| *n == row);
        if self.stats.caught.len() == caught && parts.len() > k && answered {
            // Every answer agrees with the check row's own: its projection was the lie.
            self.convict(Caught {
                node: row,
                step: format!("{what} projection"),
                residual: worst,
                threshold,
                witnesses: parts
                    .iter()
                    .map(|(n, _)| *n)
                    .filter(|&n| n != row)
                    .collect(),
                missing_update: None,
            });
            parts.retain(|(n, _)| *n != row);
            self.sketch = None;
        }
        Ok(out)
    }

    /// Freivalds' check of a backward round (docs/verification.md). Now that the answers
    /// `a_i = S_iᵀ·u_i` are in (`inputs` holds each member's `u_i`), draws a random `r`, runs a
    /// checked forward round of the stage at `x = r`, predicts each member's `S_i·r` from k
    /// answers other than its own, and checks `r·a_i[τ] ≈ u_i[τ]·(S_i·r)` for every token τ
    /// ([`transpose_residual`] within [`VerifyConfig::backward_threshold`]). A member that
    /// fails is recorded in [`ExecStats::caught`] and dropped; returns whether all passed.
    pub(super) async fn check_backward(
        &mut self,
        stage: Stage,
        t: usize,
        inputs: &Parts,
        answers: &Parts,
    ) -> Result<bool, CodedError> {
        let k = self.generator.k();
        let (inp, lens) = self.stage_layout(stage);
        let c: usize = lens.iter().sum();
        let r = random_input(&mut self.checks, inp);
        let req = StepRequest::Matmul {
            stage,
            t: 1,
            x: r.clone(),
        };
        let (_, forward) = self
            .run_with_parts(&req, c, &format!("{stage:?} backward check"))
            .await?;
        let started = Instant::now();
        self.stats.checked_backward_rounds += 1;
        let mut passed = true;
        for (node, a) in answers {
            let u = inputs
                .iter()
                .find(|(n, _)| n == node)
                .map(|(_, u)| u.as_slice())
                .ok_or_else(|| CodedError::Member {
                    node: *node,
                    reason: "answered a backward step it was not asked".into(),
                })?;
            // Its own forward answer must not vouch for its backward one: predict from k others
            // where the round has them.
            let others = forward.iter().filter(|(n, _)| n != node).count();
            let mut refs: Vec<(usize, &[f32])> = forward
                .iter()
                .filter(|(n, _)| others < k || n != node)
                .take(k)
                .map(|(n, v)| (*n, v.as_slice()))
                .collect();
            let witnesses: Vec<usize> = refs.iter().map(|(n, _)| *n).collect();
            refs.push((*node, &[]));
            let (_, kappa, predicted) = self.decode_and_predict(&refs, c)?;
            let p = predicted.first().map_or(&[][..], Vec::as_slice);
            let threshold = self.verify.backward_threshold(kappa, p.len(), inp);
            let res = transpose_residual(&r, a, u, p, &lens, t)?;
            if res <= threshold {
                let ratio = self.stats.max_backward_pass_ratio.max(res / threshold);
                self.stats.max_backward_pass_ratio = ratio;
                continue;
            }
            passed = false;
            self.convict(Caught {
                node: *node,
                step: format!("{stage:?} backward"),
                residual: res,
                threshold,
                witnesses,
                missing_update: None,
            });
        }
        // The backward rows stay the ones decoded last, so the next step uses them again.
        let rows: Vec<usize> = inputs.iter().map(|(n, _)| *n).collect();
        if passed {
            self.decoder_for(&rows)?;
        }
        self.stats.decode_time += started.elapsed();
        Ok(passed)
    }
}
