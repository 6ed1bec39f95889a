"""P2's knapsacks: pick one option per job (how many GPUs to add or take away).

Each (job, k) pair is an item of weight k; a job contributes at most one item. This is a 0/1
knapsack over those items with the "one per job" constraint (a grouped knapsack), solved by
dynamic programming over (jobs considered, GPUs used) with back-tracking to recover the choice.
O(jobs · capacity · options) time.
"""

from __future__ import annotations

from collections.abc import Sequence

_UNREACHABLE = float("-inf")


def solve_grouped_knapsack(
    values: Sequence[Sequence[float]], capacity: int, *, exact: bool = False
) -> tuple[float, list[int]]:
    """Maximise Σ values[i][k_i] subject to Σ k_i ≤ capacity (or = capacity when ``exact``).

    ``values[i][k]`` is job i's value for taking option k (k units); option 0 must exist. Returns
    (best total, [k_i per job]). On ties the smaller option for the later job wins, so answers are
    deterministic. Raises ValueError when ``exact`` and no choice sums to ``capacity``.
    """
    if capacity < 0:
        raise ValueError(f"knapsack capacity {capacity} is negative")
    if any(len(options) == 0 for options in values):
        raise ValueError("every job needs at least option 0 (take nothing)")

    # best[c] = the best total using the jobs seen so far and exactly c units.
    best = [0.0] + [_UNREACHABLE] * capacity
    choices: list[list[int]] = []  # choices[i][c] = option taken by job i when exactly c used
    for options in values:
        new_best = [_UNREACHABLE] * (capacity + 1)
        choice = [0] * (capacity + 1)
        for used in range(capacity + 1):
            for k in range(min(len(options) - 1, used) + 1):
                before = best[used - k]
                if before == _UNREACHABLE:
                    continue
                total = before + options[k]
                if total > new_best[used]:
                    new_best[used] = total
                    choice[used] = k
        best = new_best
        choices.append(choice)

    if exact:
        end = capacity
        if best[end] == _UNREACHABLE:
            raise ValueError(f"no choice of options uses exactly {capacity} units")
    else:
        end = max(range(capacity + 1), key=lambda c: (best[c], -c))

    # Back-track from the last job to the first.
    taken = [0] * len(values)
    used = end
    for index in range(len(values) - 1, -1, -1):
        taken[index] = choices[index][used]
        used -= taken[index]
    return best[end], taken
