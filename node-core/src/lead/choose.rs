//! Rounds or hops for each pass, by what passes of each route took for the rows they ran. A
//! pass's time grows with its rows where a link's rate bounds it (a long prompt over a home's
//! uplink): a hop group's member sends its part to every other member, a rounds member only to
//! the leader, so a long prompt can go faster by rounds though a token goes faster by hops.
//! Changing route starts every sequence again from its text (the keys and values live where
//! the last pass ran), so a leader leaves the route its keys are on only when the other is
//! faster for the whole restart, or once staying has cost it as much as restarting would
//! (the ski-rental rule: never worse than twice the better of the two). No I/O: times are
//! passed in.

use web_time::Duration;

/// How the next pass travels, as the leader's rules chose it ([`super::steer::Steer`]): from
/// its [`super::route::PassRoute`], what it measured of the group's rounds and what each
/// route's passes took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The leader decodes every stage.
    Rounds,
    /// The members pass their coded outputs to each other, one hop per stage.
    Hop,
}

/// The weight an older pass keeps against each later one (the last few dozen passes count).
pub const FIT_DECAY: f64 = 0.95;

/// A pass's time per row at which the rows decide: a fit whose rows cost at least as much as
/// its fixed time, for the pass asked, is bound by a link's rate.
const BOUND_SHARE: f64 = 1.0;

/// Spread of rows (their weighted variance, rows²) below which a fit has no slope.
const MIN_SPREAD: f64 = 1.0;

/// Rows of the longest pass, and four times the shortest's, from which a fit's line holds at
/// any size (a prompt and its tokens; drafted tokens alone vary too little to tell a rate).
pub const WIDE_ROWS: usize = 16;

/// A route's pass times against the rows they ran: `seconds = fixed + per_row × rows`, fitted
/// by least squares with older passes weighing less ([`FIT_DECAY`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PassFit {
    /// Sum of the weights, and of weighted rows, seconds, rows² and rows × seconds.
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
    /// The fewest and the most rows a pass measured ran.
    least: usize,
    most: usize,
}

impl PassFit {
    /// Counts a pass of `rows` rows that took `took`.
    pub fn observe(&mut self, rows: usize, took: Duration) {
        let (x, y) = (rows as f64, took.as_secs_f64());
        for s in [
            &mut self.w,
            &mut self.x,
            &mut self.y,
            &mut self.xx,
            &mut self.xy,
        ] {
            *s *= FIT_DECAY;
        }
        self.w += 1.0;
        self.x += x;
        self.y += y;
        self.xx += x * x;
        self.xy += x * y;
        self.least = if self.most == 0 {
            rows
        } else {
            self.least.min(rows)
        };
        self.most = self.most.max(rows);
    }

    /// The fixed time of a pass and its time a row, in seconds: no slope (`None`) where the
    /// passes measured ran too alike a number of rows.
    fn line(&self) -> Option<(f64, Option<f64>)> {
        if self.w <= 0.0 {
            return None;
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let spread = self.xx / self.w - mx * mx;
        if spread < MIN_SPREAD {
            return Some((my, None));
        }
        let slope = ((self.xy / self.w - mx * my) / spread).max(0.0);
        Some(((my - slope * mx).max(0.0), Some(slope)))
    }

    /// The time a pass of `rows` rows takes, where the passes measured tell: at any size where
    /// they ran sizes far apart ([`WIDE_ROWS`]), else within half the fewest and twice the
    /// most rows measured.
    pub fn predict(&self, rows: usize) -> Option<Duration> {
        let (fixed, slope) = self.line()?;
        let wide = self.most >= WIDE_ROWS && self.most >= 4 * self.least.max(1);
        let within =
            (slope.is_some() && wide) || (2 * rows >= self.least && rows <= 2 * self.most.max(1));
        let secs = fixed + slope.unwrap_or(0.0) * rows as f64;
        within.then(|| Duration::from_secs_f64(secs))
    }

    /// Whether no pass was measured.
    pub fn is_empty(&self) -> bool {
        self.most == 0
    }

    /// Whether a pass of `rows` rows is bound by a link's rate: its rows cost at least
    /// [`BOUND_SHARE`] times its fixed time.
    pub fn rate_bound(&self, rows: usize) -> bool {
        self.line().is_some_and(|(fixed, slope)| {
            slope.is_some_and(|s| s * rows as f64 >= BOUND_SHARE * fixed)
        })
    }
}

/// The rows of the next pass: on the route the batch's keys and values are on (`stay`), and
/// on the other, where every sequence starts again from its text (`all`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PassRows {
    /// Rows where the keys and values are.
    pub stay: usize,
    /// Rows with every sequence started again.
    pub all: usize,
}

/// What each route's passes took, the route the keys and values are on, and what staying on
/// it cost against the other so far: [`RouteChoice::choose`] decides from them.
#[derive(Debug, Clone, Default)]
pub struct RouteChoice {
    fits: [PassFit; 2],
    /// The route of the last pass, whose keys and values the batch holds (none: every sequence
    /// starts again wherever the next pass goes).
    on: Option<Route>,
    /// Time lost by staying on `on` where the other route would have been faster.
    regret: Duration,
}

/// The fit's index of a route.
fn slot(route: Route) -> usize {
    match route {
        Route::Rounds => 0,
        Route::Hop => 1,
    }
}

/// The route that is not `route`.
fn other(route: Route) -> Route {
    match route {
        Route::Rounds => Route::Hop,
        Route::Hop => Route::Rounds,
    }
}

impl RouteChoice {
    /// A pass of `rows` rows went by `route` and took `took`: its keys and values are there now.
    pub fn ran(&mut self, route: Route, rows: usize, took: Duration) {
        if self.on != Some(route) {
            self.regret = Duration::ZERO;
        }
        self.on = Some(route);
        self.fits[slot(route)].observe(rows, took);
    }

    /// Every sequence starts again on the next pass (the group was let go, a pass failed).
    pub fn restart(&mut self) {
        (self.on, self.regret) = (None, Duration::ZERO);
    }

    /// The route whose keys and values the batch holds, if any.
    pub fn on(&self) -> Option<Route> {
        self.on
    }

    /// What `route`'s passes took, fitted.
    pub fn fit(&self, route: Route) -> &PassFit {
        &self.fits[slot(route)]
    }

    /// The route of the next pass of `rows`, where `preferred` is what the delays alone choose
    /// (the route where nothing measured tells otherwise): the one the keys and values are on
    /// unless the other is faster for the whole restart, or staying has lost as much as the
    /// restart costs beyond a pass there. Rounds not yet measured at a pass's size are tried
    /// when hops are bound by a rate at it and changing costs about this pass (a hop member
    /// sends its part to every other member, a rounds member to the leader alone).
    pub fn choose(&mut self, preferred: Route, rows: PassRows) -> Route {
        let predict = |r: Route, n: usize| self.fits[slot(r)].predict(n);
        let Some(on) = self.on else {
            // Every sequence starts again either way.
            return match (
                predict(Route::Rounds, rows.all),
                predict(Route::Hop, rows.all),
            ) {
                (Some(r), Some(h)) if r < h => Route::Rounds,
                (Some(_), Some(_)) => Route::Hop,
                _ => self.explore(preferred, preferred, rows),
            };
        };
        let alt = other(on);
        let (Some(stay), Some(alt_stay), Some(alt_all)) = (
            predict(on, rows.stay),
            predict(alt, rows.stay),
            predict(alt, rows.all),
        ) else {
            return self.explore(on, preferred, rows);
        };
        if alt_all < stay {
            return alt;
        }
        if alt_stay < stay {
            self.regret += stay - alt_stay;
            if self.regret >= alt_all.saturating_sub(alt_stay) {
                return alt;
            }
        }
        on
    }

    /// Where a pass goes when the fits cannot compare the routes at its size: by rounds not
    /// yet measured at that size where `on` is hops bound by a rate at it and changing costs
    /// about this pass; else by `preferred` where changing costs about this pass or no pass
    /// ever went by it (the delays alone tell, as they always did); else on `on`.
    fn explore(&self, on: Route, preferred: Route, rows: PassRows) -> Route {
        let cheap = 4 * rows.all <= 5 * rows.stay.max(1) || self.on.is_none();
        let hop = self.fit(Route::Hop);
        let untried = self.fit(Route::Rounds).predict(rows.all).is_none();
        if cheap && on == Route::Hop && untried && hop.rate_bound(rows.all) {
            return Route::Rounds;
        }
        if cheap || self.fit(preferred).is_empty() {
            preferred
        } else {
            on
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seconds as a duration.
    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    #[test]
    fn a_fit_finds_the_fixed_time_and_the_time_a_row() {
        let mut f = PassFit::default();
        assert_eq!(f.predict(1), None, "nothing measured");
        for _ in 0..5 {
            f.observe(1, s(0.1 + 0.01));
        }
        // One size measured: its time, near it only.
        assert_eq!(f.predict(1), Some(s(0.11)));
        assert_eq!(f.predict(2), Some(s(0.11)));
        assert_eq!(f.predict(300), None);
        assert!(!f.rate_bound(300), "no slope yet");
        f.observe(300, s(0.1 + 0.01 * 300.0));
        let at = |n: usize| f.predict(n).unwrap().as_secs_f64();
        assert!((at(1) - 0.11).abs() < 1e-9, "{}", at(1));
        assert!(
            (at(1000) - 10.1).abs() < 1e-9,
            "sizes far apart: {}",
            at(1000)
        );
        assert!(
            f.rate_bound(300) && !f.rate_bound(5),
            "3 s of rows against 0.1 s fixed"
        );
    }

    /// A world where hops take `hop` and rounds `rounds` for a pass of so many rows (fixed
    /// plus a time a row): the leader's choices and the time they took for `passes`, each of
    /// a new prompt's rows or one (a token), one sequence at a time.
    fn run(
        choice: &mut RouteChoice,
        hop: (f64, f64),
        rounds: (f64, f64),
        passes: &[usize],
    ) -> (Vec<Route>, f64) {
        run_preferring(choice, Route::Hop, hop, rounds, passes)
    }

    /// [`run`], the delays preferring `preferred`.
    fn run_preferring(
        choice: &mut RouteChoice,
        preferred: Route,
        hop: (f64, f64),
        rounds: (f64, f64),
        passes: &[usize],
    ) -> (Vec<Route>, f64) {
        let (mut routes, mut total, mut text) = (Vec::new(), 0.0, 0);
        for &new in passes {
            if new > 1 {
                // A new sequence: the last one ended.
                text = 0;
            }
            let stay = new;
            text += new;
            let rows = PassRows { stay, all: text };
            let route = choice.choose(preferred, rows);
            let n = if Some(route) == choice.on { stay } else { text };
            let (fixed, per_row) = if route == Route::Hop { hop } else { rounds };
            let took = fixed + per_row * n as f64;
            choice.ran(route, n, s(took));
            routes.push(route);
            total += took;
        }
        (routes, total)
    }

    #[test]
    fn a_long_prompt_over_a_slow_link_goes_by_rounds_once_hops_were_measured_at_its_size() {
        // Hops: 3 s a token's network less, but each row costs three parts on a home's
        // uplink; rounds: twice the delays, a third of the bytes.
        let (hop, rounds) = ((3.0, 0.06), (6.0, 0.02));
        let mut c = RouteChoice::default();
        let prompt = |n: usize| std::iter::once(300).chain(std::iter::repeat_n(1, n));
        let passes: Vec<usize> = prompt(4).chain(prompt(4)).collect();
        let (routes, _) = run(&mut c, hop, rounds, &passes);
        // The first prompt goes by hops (nothing measured says otherwise), as do its tokens.
        assert!(routes[..5].iter().all(|&r| r == Route::Hop), "{routes:?}");
        // Hops measured at 300 rows are bound by the link: the next prompt tries rounds, and
        // its few tokens stay there (restarting 300 rows by hops costs more than they lose).
        assert_eq!(routes[5], Route::Rounds, "{routes:?}");
        assert!(
            routes[6..].iter().all(|&r| r == Route::Rounds),
            "{routes:?}"
        );
        // A third prompt: both routes measured, rounds predicted faster for it.
        let (routes, _) = run(&mut c, hop, rounds, &[300]);
        assert_eq!(routes, [Route::Rounds]);
    }

    #[test]
    fn a_long_answer_goes_back_to_hops_once_its_tokens_lost_what_the_restart_costs() {
        let (hop, rounds) = ((3.0, 0.06), (6.0, 0.02));
        let mut c = RouteChoice::default();
        // Measure both routes: a prompt by hops, one by rounds, each with a token.
        run(&mut c, hop, rounds, &[300, 1, 1, 300, 1]);
        let answer: Vec<usize> = std::iter::once(300)
            .chain(std::iter::repeat_n(1, 40))
            .collect();
        let (routes, total) = run(&mut c, hop, rounds, &answer);
        assert_eq!(routes[0], Route::Rounds, "the prompt by rounds");
        let back = routes
            .iter()
            .position(|&r| r == Route::Hop)
            .expect("back to hops");
        // Restarting ~300 rows by hops costs about 18 s beyond a token there; each token by
        // rounds loses 3 s: back within seven tokens, and no flapping after.
        assert!((2..=8).contains(&back), "{routes:?}");
        assert!(
            routes[back..].iter().all(|&r| r == Route::Hop),
            "{routes:?}"
        );
        // Within twice the better of all-rounds and all-hops.
        let all = |(fixed, per): (f64, f64)| (fixed + per * 300.0) + 40.0 * (fixed + per);
        assert!(total <= 2.0 * all(hop).min(all(rounds)), "{total}");
        assert!(
            total < all(rounds),
            "better than rounds throughout: {total}"
        );
    }

    #[test]
    fn short_prompts_keep_to_the_preferred_route() {
        // Rows cost little on either route: the delays decide, as before.
        let mut c = RouteChoice::default();
        let passes: Vec<usize> = [20, 1, 1, 30, 1, 1, 25, 1].to_vec();
        let (routes, _) = run(&mut c, (3.0, 0.001), (6.0, 0.0005), &passes);
        assert!(routes.iter().all(|&r| r == Route::Hop), "{routes:?}");
    }

    #[test]
    fn a_group_found_far_mid_answer_goes_by_hops_where_no_pass_ever_did() {
        // Rounds measured a prompt and a token; then the delays prefer hops (the rounds wait
        // on the network). Nothing says what hops cost: the delays decide, as they always did.
        let mut c = RouteChoice::default();
        c.ran(Route::Rounds, 140, s(9.0));
        c.ran(Route::Rounds, 1, s(6.02));
        let token = PassRows { stay: 1, all: 142 };
        assert_eq!(c.choose(Route::Hop, token), Route::Hop);
        // Once hops were measured, the restart is weighed instead.
        c.ran(Route::Hop, 142, s(20.0));
        c.ran(Route::Rounds, 143, s(9.0));
        assert_eq!(
            c.choose(Route::Hop, PassRows { stay: 1, all: 144 }),
            Route::Rounds
        );
    }

    #[test]
    fn rounds_bound_by_their_compute_never_try_hops_unasked() {
        // One machine: a prompt's rows cost compute by rounds, and hops were never measured.
        let mut c = RouteChoice::default();
        let passes: Vec<usize> = [300, 1, 1, 300, 1, 300].to_vec();
        let (routes, _) = run_preferring(&mut c, Route::Rounds, (6.0, 0.02), (0.1, 0.02), &passes);
        assert!(routes.iter().all(|&r| r == Route::Rounds), "{routes:?}");
    }

    #[test]
    fn a_restart_forgets_where_the_keys_were_and_what_staying_lost() {
        let mut c = RouteChoice::default();
        c.ran(Route::Rounds, 300, s(12.0));
        c.ran(Route::Rounds, 1, s(6.02));
        c.restart();
        // Nothing measured by hops at 300 rows, and no keys anywhere: the preferred route.
        let rows = PassRows {
            stay: 300,
            all: 300,
        };
        assert_eq!(c.choose(Route::Hop, rows), Route::Hop);
        assert_eq!(c.regret, Duration::ZERO);
    }
}
