//! The engine's queue, batch and minibatch rules, without a mesh.

use super::worker::Next;
use super::*;

/// A queued request with `prompt` as its prompt, and where its events would go.
fn job(prompt: u32) -> (Job, mpsc::UnboundedReceiver<Event>) {
    let (events, rx) = mpsc::unbounded_channel();
    let req = GenRequest {
        prompt: vec![prompt],
        max_tokens: 1,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        learn: true,
        lesson: None,
        caller: "anonymous".into(),
        budget: node_core::learn::Budget {
            capacity: node_core::learn::BUDGET_TOKENS,
            refill_per_s: node_core::learn::BUDGET_REFILL_PER_S,
        },
        asks: Asks::default(),
    };
    let job = Job {
        id: u64::from(prompt),
        req,
        events,
        arrived: Instant::now(),
        span: tracing::Span::none(),
    };
    (job, rx)
}

/// An intake over a queue holding requests with these prompts, as `Engine::submit` leaves it.
fn intake(
    prompts: &[u32],
) -> (
    Intake,
    mpsc::Sender<Job>,
    Vec<mpsc::UnboundedReceiver<Event>>,
) {
    let (tx, jobs) = mpsc::channel(8);
    let queue_depth = Gauge::default();
    let mut events = Vec::new();
    for &p in prompts {
        let (j, rx) = job(p);
        tx.try_send(j).unwrap();
        queue_depth.inc();
        events.push(rx);
    }
    let intake = Intake {
        jobs: Arc::new(tokio::sync::Mutex::new(jobs)),
        held: None,
        queue_depth,
    };
    (intake, tx, events)
}

fn prompt(next: Next) -> Option<u32> {
    match next {
        Next::Job(j) => Some(j.req.prompt[0]),
        Next::Empty | Next::Closed => None,
    }
}

#[test]
fn a_busy_task_leaves_a_request_to_a_task_with_a_group_and_nothing_to_serve() {
    let shared = Shared::new(3, Gauge::default());
    let peer = PeerId::random();
    assert!(!shared.another_is_idle(0), "no other task has a group");
    shared.set_busy(1, vec![peer]);
    assert!(
        shared.another_is_idle(0),
        "task 1 just formed its group: it takes the next request"
    );
    assert!(!shared.another_is_idle(1), "not itself");
    shared.set_active(1, 1);
    assert!(!shared.another_is_idle(0), "task 1 is serving");
    shared.set_active(1, 0);
    shared.set_busy(1, Vec::new());
    assert!(!shared.another_is_idle(0), "task 1 lost its group");
}

#[tokio::test]
async fn training_waits_its_turn_while_serving_and_goes_on_once_serving_is_idle() {
    let shared = Arc::new(Shared::new(2, Gauge::default()));
    // Turns whose last round began `ago`.
    let worked = |ago: Duration| {
        let mut turns = Turns::default();
        turns.began(Instant::now() - ago);
        turns
    };
    // Nothing served: no wait, however long the trainer worked.
    let t = Instant::now();
    shared.wait_turn(&worked(Duration::from_secs(100))).await;
    assert!(t.elapsed() < Duration::from_secs(1));
    shared.set_active(0, 2);
    shared.set_active(1, 1);
    // Serving: after 30 ms of work it waits 30 · 0.85 / 0.15 = 170 ms.
    let t = Instant::now();
    shared.wait_turn(&worked(Duration::from_millis(30))).await;
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(170) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    let mut waiter = tokio::spawn({
        let shared = shared.clone();
        let turns = worked(Duration::from_secs(100));
        async move { shared.wait_turn(&turns).await }
    });
    shared.set_active(0, 0);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), &mut waiter)
            .await
            .is_err(),
        "one serving task still has a sequence: the trainer must still wait"
    );
    shared.set_active(1, 0);
    waiter
        .await
        .expect("every serving task is idle: the trainer goes on");
}

#[tokio::test]
async fn waiting_idle_with_a_held_request_keeps_it_and_the_queue() {
    // The load benchmark's lost requests: while the trainer was behind, every idle wait
    // took the next request into the one held slot, dropping the request already there.
    let (mut intake, _tx, events) = intake(&[1, 2, 3]);
    assert!(intake.idle(Duration::from_millis(1)).await);
    assert_eq!(intake.queue_depth.get(), 2, "one request left the queue");
    for _ in 0..3 {
        assert!(intake.idle(Duration::from_millis(1)).await);
    }
    assert_eq!(intake.queue_depth.get(), 2, "no other request was taken");
    for rx in &events {
        assert!(
            !rx.is_closed(),
            "every request is still alive to be answered"
        );
    }
    let order: Vec<_> = (0..4).map(|_| prompt(intake.next())).collect();
    assert_eq!(order, [Some(1), Some(2), Some(3), None]);
    assert_eq!(intake.queue_depth.get(), 0);
}

#[test]
fn a_request_held_back_for_room_comes_first() {
    let (mut intake, _tx, _events) = intake(&[1, 2]);
    let Next::Job(first) = intake.next() else {
        panic!("a queued request")
    };
    intake.hold(*first);
    let order: Vec<_> = (0..3).map(|_| prompt(intake.next())).collect();
    assert_eq!(order, [Some(1), Some(2), None]);
}

#[tokio::test]
async fn a_closed_queue_ends_the_intake_only_once_the_held_request_is_out() {
    let (mut intake, tx, _events) = intake(&[7]);
    drop(tx);
    assert!(intake.idle(Duration::from_millis(1)).await);
    assert!(intake.idle(Duration::from_millis(1)).await, "7 is held");
    assert_eq!(prompt(intake.next()), Some(7));
    assert!(matches!(intake.next(), Next::Closed));
    assert!(!intake.idle(Duration::from_millis(1)).await);
}

#[tokio::test]
async fn an_idle_wait_with_nothing_queued_takes_nothing() {
    let (mut intake, _tx, _events) = intake(&[]);
    assert!(intake.idle(Duration::from_millis(1)).await);
    assert!(matches!(intake.next(), Next::Empty));
}
