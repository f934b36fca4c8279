"""Improved precision and recall (Kynkaanniemi et al. 2019, arXiv:1904.06991), and class coverage.

Each set of feature vectors stands for a manifold: the union of balls around its points, each ball's radius the
distance to that point's k-th nearest neighbour within its own set (sec. 3, k = 3 as in the paper).
    precision = share of generated samples that fall inside the real manifold   (quality: no junk)
    recall    = share of real samples that fall inside the generated manifold   (diversity: no missing modes)
Distances are Euclidean in float64, computed in row chunks so N x N never has to fit in memory at once.
"""

from __future__ import annotations

import math

import numpy as np
import torch

DEFAULT_K = 3


def _pairwise(a_AD: torch.Tensor, b_BD: torch.Tensor) -> torch.Tensor:
    """Euclidean distances (A, B) in float64 via |a|^2 + |b|^2 - 2 a.b (clamped at 0 against round-off)."""
    d2 = (a_AD * a_AD).sum(1)[:, None] + (b_BD * b_BD).sum(1)[None, :] - 2.0 * (a_AD @ b_BD.T)
    return d2.clamp_(min=0.0).sqrt_()


def knn_radii(feats_ND: torch.Tensor, k: int = DEFAULT_K, chunk: int = 1024) -> torch.Tensor:
    """Distance from each point to its k-th nearest neighbour in the same set (itself excluded), (N,)."""
    n = feats_ND.shape[0]
    if n <= k:
        raise ValueError(f"k-NN radii with k={k} need more than {k} feature vectors, got {n}")
    out = torch.empty(n, dtype=torch.float64, device=feats_ND.device)
    for s in range(0, n, chunk):
        d = _pairwise(feats_ND[s:s + chunk], feats_ND)
        # The k+1-th smallest: the smallest is the point itself at distance 0.
        out[s:s + chunk] = d.kthvalue(k + 1, dim=1).values
    return out


def inside_manifold(query_QD: torch.Tensor, ref_ND: torch.Tensor, ref_radii_N: torch.Tensor,
                    chunk: int = 1024) -> torch.Tensor:
    """(Q,) bool: query point q lies within some ball B(ref_i, radius_i)."""
    hits = torch.empty(query_QD.shape[0], dtype=torch.bool, device=query_QD.device)
    for s in range(0, query_QD.shape[0], chunk):
        hits[s:s + chunk] = (_pairwise(query_QD[s:s + chunk], ref_ND) <= ref_radii_N[None, :]).any(1)
    return hits


def precision_recall(real_ND, fake_MD, *, k: int = DEFAULT_K, device: torch.device | str = "cpu") -> dict:
    """{'precision', 'recall', 'k', 'num_real', 'num_fake'} of generated features against real ones."""
    real = torch.as_tensor(np.asarray(real_ND) if not isinstance(real_ND, torch.Tensor) else real_ND)
    fake = torch.as_tensor(np.asarray(fake_MD) if not isinstance(fake_MD, torch.Tensor) else fake_MD)
    real = real.to(device=device, dtype=torch.float64)
    fake = fake.to(device=device, dtype=torch.float64)
    precision = inside_manifold(fake, real, knn_radii(real, k)).double().mean()
    recall = inside_manifold(real, fake, knn_radii(fake, k)).double().mean()
    return {"precision": float(precision), "recall": float(recall), "k": k,
            "num_real": int(real.shape[0]), "num_fake": int(fake.shape[0])}


def class_coverage(pred_labels: np.ndarray, num_classes: int) -> dict:
    """How the classifier labels the samples: does the model cover every class, in proportion?

    classes_present: share of classes predicted at least once (1.0 = none missing)
    entropy_ratio:   entropy of the predicted-label histogram / log(num_classes) (1.0 = perfectly balanced)
    kl_to_uniform:   KL(p || uniform) = log(num_classes) - entropy, in nats (0 = balanced)
    """
    counts = np.bincount(np.asarray(pred_labels, dtype=np.int64), minlength=num_classes)[:num_classes]
    total = int(counts.sum())
    p = counts / max(total, 1)
    nz = p[p > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    log_k = math.log(num_classes) if num_classes > 1 else 1.0
    return {"classes_present": float((counts > 0).mean()), "entropy_ratio": entropy / log_k,
            "kl_to_uniform": log_k - entropy if num_classes > 1 else 0.0,
            "label_histogram": [int(c) for c in counts]}
