"""Least-squares repair for structured pruning: Gram statistics over calibration tokens, Optimal Brain Surgeon
selection of the column groups to keep, and the relative error of the repaired projection."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.surgery.errors import PruneError


class GramAccumulator:
    """Running X^T X and X^T Y (X with an intercept column) over the non-padding tokens of many batches."""

    def __init__(self, n_in: int, n_out: int) -> None:
        self.gram = torch.zeros(n_in + 1, n_in + 1, dtype=torch.float64)
        self.cross = torch.zeros(n_in + 1, n_out, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> None:
        keep = mask.reshape(-1).bool()
        x = x.reshape(-1, x.shape[-1])[keep].to(torch.float32)
        y = y.reshape(-1, y.shape[-1])[keep].to(torch.float32)
        x = torch.cat([x, torch.ones(len(x), 1)], 1)
        self.gram += (x.T @ x).double()
        self.cross += (x.T @ y).double()


def obs_select(gram: torch.Tensor, cross: torch.Tensor, groups: Sequence[Sequence[int]], keep: int,
               damp: float = 1e-3) -> tuple[list[int], torch.Tensor]:
    """Keep `keep` of the column `groups` of X that best reproduce Y, and their least-squares weights.

    `gram` = X^T X and `cross` = X^T Y, with X's last column the intercept (never removed). Groups are
    removed one at a time by Optimal Brain Surgeon: the cost of dropping group B from the current
    solution W is tr(W_B^T [(X^T X)^-1]_BB^-1 W_B); after each removal W and the inverse are updated in
    closed form. Single-column groups (FFN neurons) are removed in chunks of 1/8 of what is left to remove,
    which keeps 1,000 removals to a few dozen updates. Returns the kept group indices (ascending) and the
    ridge solution on the kept columns plus intercept, shape (kept columns + 1, outputs).
    """
    n = gram.shape[0]
    if not 1 <= keep <= len(groups):
        raise PruneError(f"cannot keep {keep} of {len(groups)} groups")
    ridge = damp * torch.diag(gram).mean() * torch.eye(n, dtype=torch.float64)
    inv = torch.linalg.inv(gram + ridge)
    sol = inv @ cross
    alive = list(range(len(groups)))
    singles = all(len(g) == 1 for g in groups)
    while len(alive) > keep:
        if singles:
            idx = torch.tensor([groups[a][0] for a in alive])
            cost = (sol[idx] ** 2).sum(1) / torch.diag(inv)[idx]
            chunk = max(1, (len(alive) - keep) // 8)
            removed = [alive[i] for i in cost.argsort()[:chunk].tolist()]
        else:
            costs = {a: _group_cost(sol, inv, list(groups[a])) for a in alive}
            removed = [min(costs, key=costs.__getitem__)]
        # removing a set at once is the same closed-form update as removing its members one by one
        b = torch.tensor([c for a in removed for c in groups[a]])
        block_inv = torch.linalg.inv(inv[b][:, b])
        sol = sol - inv[:, b] @ block_inv @ sol[b]
        inv = inv - inv[:, b] @ block_inv @ inv[b, :]
        sol[b] = 0.0
        gone = set(removed)
        alive = [a for a in alive if a not in gone]
    cols = torch.tensor([*sorted(c for a in alive for c in groups[a]), n - 1])
    weights = torch.linalg.solve(gram[cols][:, cols] + ridge[cols][:, cols], cross[cols])
    return alive, weights


def _group_cost(sol: torch.Tensor, inv: torch.Tensor, cols: list[int]) -> float:
    """OBS: how much the least-squares error grows when these columns are removed from the solution."""
    return float(torch.trace(sol[cols].T @ torch.linalg.solve(inv[cols][:, cols], sol[cols])))


def relative_error(gram: torch.Tensor, cross: torch.Tensor, target_sq: float, cols: torch.Tensor,
                   weights: torch.Tensor) -> float:
    """||X_S W - Y||^2 / ||Y||^2 from the accumulated statistics (what the repair could not reproduce)."""
    fit = weights.T @ gram[cols][:, cols] @ weights
    err = target_sq - 2 * float(torch.trace(weights.T @ cross[cols])) + float(torch.trace(fit))
    return max(err, 0.0) / max(target_sq, 1e-12)
