"""P2's algorithm steps on small cases worked by hand from the paper's formulas.

Section 2.3: job i has ``job[i]`` epochs left, holds ``s[i]`` GPUs and takes ``f_i(g)`` seconds
per epoch on g GPUs.
- Expansion (equation (3), Algorithm 1): with K idle GPUs, increments inc[i] with Σ inc ≤ K
  maximising Σ delta[i], delta[i] = (f_i(s[i]) − f_i(s[i] + inc[i])) × job[i].
- Reduction (equation (6), Algorithm 2): with K new requests and no idle GPU, reclaim
  K' = min(K, P − m) GPUs (every job keeps one) by decrements with Σ dec = K' minimising
  Σ nabla[i], nabla[i] = (f_i(s[i] − dec[i]) − f_i(s[i])) × job[i].
- Placement (section 2.4, Algorithm 3): jobs that change size, largest first; each on the
  node with the fewest free GPUs that holds it whole, else the node with the most free GPUs
  takes what it can and the rest is placed the same way.

Every job here has the profile "f(g) = T / g" (one-GPU epoch time T, linear scaling: P2's
preset before anything is measured), unless it carries measurements.
"""

from __future__ import annotations

from coordinator.scheduling.elastic import ElasticPolicy, fit_epoch_time
from coordinator.scheduling.model import (
    ClusterState,
    JobSpec,
    JobState,
    ModelProfile,
    Node,
    Resize,
    Start,
    Wait,
)

SAMPLES_PER_EPOCH = 1000


def job(job_id: str, epoch_s: float, epochs_left: float, *, epochs: float = 40) -> JobSpec:
    """A job whose one-GPU epoch takes ``epoch_s`` (linear scaling in its profile)."""
    profile = ModelProfile(f"T={epoch_s:g}", (SAMPLES_PER_EPOCH / epoch_s, 0.0, 0.0))
    assert epochs >= epochs_left
    return JobSpec(
        job_id,
        0.0,
        1,
        profile,
        samples=epochs * SAMPLES_PER_EPOCH,
        samples_per_epoch=SAMPLES_PER_EPOCH,
        batch_size=32,
        batch_per_gpu=True,
        max_gpus=12,
    )


def running(
    job_id: str,
    epoch_s: float,
    epochs_left: float,
    placement: dict[str, int],
    observations: tuple[tuple[int, float], ...] = (),
) -> JobState:
    spec = job(job_id, epoch_s, epochs_left)
    done = spec.samples - epochs_left * SAMPLES_PER_EPOCH
    return JobState(spec, placement, done, observations=observations, first_start=0.0)


def waiting(job_id: str) -> JobState:
    return JobState(job(job_id, 60.0, 40))


def state(
    free: dict[str, int], runs: tuple[JobState, ...], waits: tuple[JobState, ...] = ()
) -> ClusterState:
    nodes = {name: Node(name, 4, count) for name, count in free.items()}
    return ClusterState(0.0, nodes, {}, runs, waits)


def sizes(decisions: list) -> dict[str, int]:
    """GPUs each started or resized job gets."""
    return {d.job_id: sum(d.placement.values()) for d in decisions if isinstance(d, Start | Resize)}


# --- expansion --------------------------------------------------------------------------------


def test_expansion_spreads_when_two_single_increments_gain_most() -> None:
    # A: T = 60 s, 10 epochs left; B: T = 120 s, 4 left; both on 1 GPU; K = 2 idle.
    #   delta_A(+1) = (60 − 30) × 10 = 300    delta_A(+2) = (60 − 20) × 10 = 400
    #   delta_B(+1) = (120 − 60) × 4 = 240    delta_B(+2) = (120 − 40) × 4 = 320
    # Best with Σ inc ≤ 2: A +1 and B +1 = 540 (A +2 alone: 400; B +2 alone: 320).
    runs = (running("A", 60, 10, {"n1": 1}), running("B", 120, 4, {"n1": 1}))
    decisions = ElasticPolicy().schedule(state({"n1": 2}, runs))
    assert sizes(decisions) == {"A": 2, "B": 2}
    assert all(isinstance(d, Resize) for d in decisions)


def test_expansion_gives_both_gpus_to_the_job_with_most_to_gain() -> None:
    # A: T = 60, 20 left; B: T = 60, 1 left; K = 2.
    #   delta_A(+1) = 30 × 20 = 600, delta_A(+2) = 40 × 20 = 800
    #   delta_B(+1) = 30 × 1 = 30,   delta_B(+2) = 40 × 1 = 40
    # A +2 = 800 beats A +1, B +1 = 630: B is left alone (no rescale, no 10-s stop).
    runs = (running("A", 60, 20, {"n1": 1}), running("B", 60, 1, {"n1": 1}))
    decisions = ElasticPolicy().schedule(state({"n1": 2}, runs))
    assert sizes(decisions) == {"A": 3}


def test_expansion_uses_the_fitted_curve_once_epochs_are_measured() -> None:
    # A measured 60 s per epoch on 1 GPU and on 2: the least-squares fit of a/g + b through
    # (1, 60) and (2, 60) is a = 0, b = 60, so more GPUs gain A nothing (delta_A = 0) even
    # though it has 30 epochs left. B (T = 120, 1 left) takes both idle GPUs:
    #   delta_B(+2) = (120 − 40) × 1 = 80 > delta_B(+1) = 60.
    fitted = fit_epoch_time([(1, 60.0), (2, 60.0)], default=lambda g: 1.0)
    assert [fitted(g) for g in (1, 2, 4)] == [60.0, 60.0, 60.0]
    runs = (
        running("A", 60, 30, {"n1": 1}, observations=((1, 60.0), (2, 60.0))),
        running("B", 120, 1, {"n1": 1}),
    )
    decisions = ElasticPolicy().schedule(state({"n1": 2}, runs))
    assert sizes(decisions) == {"B": 3}


def test_a_known_curve_replaces_the_fit() -> None:
    # The same case with A's flat curve given instead of measured.
    def known(spec: JobSpec, gpus: int) -> float:
        return 60.0 if spec.job_id == "A" else 120.0 / gpus

    runs = (running("A", 60, 30, {"n1": 1}), running("B", 120, 1, {"n1": 1}))
    decisions = ElasticPolicy(known_epoch_time=known).schedule(state({"n1": 2}, runs))
    assert sizes(decisions) == {"B": 3}


def test_a_new_request_starts_on_one_gpu_and_the_idle_rest_expands_it() -> None:
    # Principle (3): one GPU at once; then expansion: with f = 60/g and 40 epochs, every
    # extra GPU gains, so the lone job takes all 4 in one start (no rescale).
    decisions = ElasticPolicy().schedule(state({"n1": 4}, (), (waiting("new"),)))
    assert decisions == [Start("new", {"n1": 4}, "started on 4 GPUs")]


# --- reduction --------------------------------------------------------------------------------


def test_reduction_reclaims_k_gpus_at_least_loss_and_places_by_best_fit() -> None:
    # P = 8 on two servers, all held: A 4 on n1 (T = 60, 10 left), B 3 on n2 (T = 120, 2
    # left), C 1 on n2. K = 2 requests, m = 3: K' = min(2, 8 − 3) = 2.
    #   nabla_A(−1) = (20 − 15) × 10 = 50, nabla_A(−2) = (30 − 15) × 10 = 150
    #   nabla_B(−1) = (60 − 40) × 2 = 40,  nabla_B(−2) = (120 − 40) × 2 = 160
    # Exactly 2: A −1 and B −1 = 90 (A −2: 150, B −2: 160). A → 3, B → 2, D and E get 1.
    runs = (
        running("A", 60, 10, {"n1": 4}),
        running("B", 120, 2, {"n2": 3}),
        running("C", 60, 5, {"n2": 1}),
    )
    decisions = ElasticPolicy().schedule(
        state({"n1": 0, "n2": 0}, runs, (waiting("D"), waiting("E")))
    )
    assert sizes(decisions) == {"A": 3, "B": 2, "D": 1, "E": 1}
    # Best fit on the released GPUs (n1: 4, n2: 3; C keeps its GPU), largest first:
    # A (3): ascending n2(3), n1(4) -> n2 fits first. B (2): only n1(4) has room -> n1.
    # D (1), E (1): n1 (2 then 1 left).
    placed = {d.job_id: dict(d.placement) for d in decisions}
    assert placed == {"A": {"n2": 3}, "B": {"n1": 2}, "D": {"n1": 1}, "E": {"n1": 1}}
    assert [type(d) for d in decisions if d.job_id in "AB"] == [Resize, Resize]


def test_reduction_stops_at_one_gpu_per_job() -> None:
    # P = 4 held by A (2), B (1), C (1); K = 3 requests, m = 3: K' = min(3, 4 − 3) = 1. Only A
    # can give a GPU; the first request starts, the other two wait.
    runs = (
        running("A", 60, 10, {"n1": 2}),
        running("B", 60, 10, {"n1": 1}),
        running("C", 60, 10, {"n1": 1}),
    )
    queue = (waiting("D"), waiting("E"), waiting("F"))
    decisions = ElasticPolicy().schedule(state({"n1": 0}, runs, queue))
    assert sizes(decisions) == {"A": 1, "D": 1}
    assert [d.job_id for d in decisions if isinstance(d, Wait)] == ["E", "F"]
