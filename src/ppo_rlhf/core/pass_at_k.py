"""pass@k: the chance that at least one of k samples of a problem is right, estimated without bias
from n >= k samples of which c are right (Chen et al., 2021, "Evaluating Large Language Models
Trained on Code", eq. 1):

    pass@k = 1 - C(n - c, k) / C(n, k)

The binomials overflow long before n reaches the sample counts people use, so it is computed as
the paper's numerically stable product:

    C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)

which is 0 (pass@k = 1) when fewer than k samples are wrong: any k of them hold a right one.
Drawing k of the n samples at once and asking whether one is right is what this averages over
every draw; the first k samples alone would be an unbiased but noisier estimate.
"""

from __future__ import annotations

import torch


def pass_at_k(correct: torch.Tensor, k: int) -> torch.Tensor:
    """(P, n) 0/1 outcomes of n samples of each of P problems -> (P,) float64 pass@k estimates."""
    n = correct.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n, the samples of a problem ({n})")
    right = correct.to(torch.float64).sum(dim=-1, keepdim=True)  # (P, 1) c
    i = torch.arange(1, n + 1, dtype=torch.float64, device=correct.device)  # (n,) 1..n
    factors = torch.where(i > n - right, 1.0 - k / i, torch.ones((), dtype=torch.float64, device=correct.device))
    all_wrong = factors.prod(dim=-1)  # (P,) C(n - c, k) / C(n, k)
    return torch.where(n - right.squeeze(-1) < k, torch.ones_like(all_wrong), 1.0 - all_wrong)
