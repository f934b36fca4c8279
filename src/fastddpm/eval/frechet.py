"""The Frechet distance between two Gaussians fitted to features: FID's formula, exact and in float64.

Heusel et al. 2017 (arXiv:1706.08500, eq. 6), the Frechet (2-Wasserstein) distance of N(mu1, S1) and N(mu2, S2):

    d^2 = |mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^(1/2))

tr((S1 S2)^(1/2)) is computed without a general (non-symmetric) matrix square root: S1 S2 is similar to the
symmetric positive semi-definite M = S1^(1/2) S2 S1^(1/2) (XY and YX share eigenvalues, with X = S1^(1/2) and
Y = S1^(1/2) S2), so tr((S1 S2)^(1/2)) = sum_i sqrt(lambda_i(M)). Two symmetric eigen-decompositions in float64
(numpy.linalg.eigh), negative round-off eigenvalues clipped to zero: no scipy.linalg.sqrtm, no complex parts to
discard, and singular covariances (fewer samples than feature dimensions, dead ReLU units) are handled exactly.

Means and covariances are accumulated batch by batch (FeatureStats) with Chan et al.'s pairwise update in
float64: no N x D matrix of all features is ever needed, and the result does not depend on the batch split
beyond float64 round-off.
"""

from __future__ import annotations

import numpy as np
import torch


class FeatureStats:
    """Streaming mean and covariance of feature vectors, in float64 on the features' device.

    Per batch: its mean and centred scatter matrix, merged into the running ones (Chan, Golub & LeVeque 1979):
        delta = mean_b - mean;  mean += delta * n_b / n;  M2 += M2_b + delta delta^T * n_a n_b / n
    which avoids the cancellation of sum(x x^T) / n - mean mean^T for features with large means.
    """

    def __init__(self, dim: int, device: torch.device | str = "cpu"):
        self.dim = dim
        self.n = 0
        self.mean = torch.zeros(dim, dtype=torch.float64, device=device)
        self.m2 = torch.zeros(dim, dim, dtype=torch.float64, device=device)

    def update(self, feats_BD: torch.Tensor) -> None:
        x = feats_BD.to(device=self.mean.device, dtype=torch.float64)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"FeatureStats({self.dim}) got features of shape {tuple(x.shape)}")
        n_b = x.shape[0]
        if n_b == 0:
            return
        mean_b = x.mean(0)
        xc = x - mean_b
        m2_b = xc.T @ xc  # (D, D)
        n = self.n + n_b
        delta = mean_b - self.mean
        self.m2 += m2_b + torch.outer(delta, delta) * (self.n * n_b / n)
        self.mean += delta * (n_b / n)
        self.n = n

    def mean_cov(self) -> tuple[np.ndarray, np.ndarray]:
        """(mu (D,), sigma (D, D)) as float64 numpy; sigma is the unbiased (N - 1) covariance, as np.cov."""
        if self.n < 2:
            raise ValueError(f"a covariance needs at least 2 feature vectors, got {self.n}")
        return self.mean.cpu().numpy().copy(), (self.m2 / (self.n - 1)).cpu().numpy()


def mean_cov(feats_ND: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance of a whole (N, D) feature matrix (through the same streaming code)."""
    x = torch.as_tensor(np.asarray(feats_ND) if not isinstance(feats_ND, torch.Tensor) else feats_ND)
    stats = FeatureStats(x.shape[1])
    stats.update(x)
    return stats.mean_cov()


def sqrtm_psd(sigma: np.ndarray) -> np.ndarray:
    """The symmetric square root of a symmetric positive semi-definite matrix (eigh; negatives clipped)."""
    w, v = np.linalg.eigh(np.asarray(sigma, dtype=np.float64))
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """d^2 between N(mu1, sigma1) and N(mu2, sigma2) (FID when both are fitted to Inception or other features)."""
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    s1, s2 = np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != (mu1.shape[0], mu1.shape[0]):
        raise ValueError(f"mismatched statistics: mu {mu1.shape} vs {mu2.shape}, sigma {s1.shape} vs {s2.shape}")
    root1 = sqrtm_psd(s1)
    m = root1 @ s2 @ root1
    m = (m + m.T) / 2  # symmetric up to round-off; eigvalsh reads one triangle, so make it exact
    tr_covmean = float(np.sqrt(np.clip(np.linalg.eigvalsh(m), 0.0, None)).sum())
    diff = mu1 - mu2
    d2 = float(diff @ diff + np.trace(s1) + np.trace(s2) - 2.0 * tr_covmean)
    # d^2 >= 0 exactly; a tiny negative value is float64 round-off of two equal distributions.
    return max(d2, 0.0)
