"""The evaluation math on its own: the Frechet distance against closed forms, streaming statistics against
numpy, precision/recall and class coverage on sets whose answers are known."""

import math

import numpy as np
import pytest
import torch

from fastddpm.eval.frechet import FeatureStats, frechet_distance, mean_cov, sqrtm_psd
from fastddpm.eval.precision_recall import class_coverage, knn_radii, precision_recall


def _random_cov(rng, d, rank=None):
    a = rng.standard_normal((d, rank or d))
    return a @ a.T / (rank or d)


def test_identical_gaussians_are_at_distance_zero():
    rng = np.random.default_rng(0)
    mu, s = rng.standard_normal(16), _random_cov(rng, 16)
    assert frechet_distance(mu, s, mu, s) == pytest.approx(0.0, abs=1e-9)


def test_diagonal_covariances_match_the_closed_form():
    """Commuting covariances: d^2 = |mu1 - mu2|^2 + sum_i (sqrt(a_i) - sqrt(b_i))^2."""
    rng = np.random.default_rng(1)
    a, b = rng.uniform(0.1, 3.0, 8), rng.uniform(0.1, 3.0, 8)
    mu1, mu2 = rng.standard_normal(8), rng.standard_normal(8)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-12)
    # Isotropic: N(0, I) vs N(0, c I) in d dimensions is d (1 - sqrt(c))^2.
    d, c = 32, 2.5
    assert frechet_distance(np.zeros(d), np.eye(d), np.zeros(d), c * np.eye(d)) == pytest.approx(
        d * (1 - math.sqrt(c)) ** 2, rel=1e-12)


def test_non_commuting_2x2_matches_the_closed_form():
    """For 2x2: tr sqrt(S1 S2) = sqrt(tr(S1 S2) + 2 sqrt(det S1 det S2)) (the eigenvalues of S1 S2 are >= 0)."""
    s1 = np.array([[2.0, 0.7], [0.7, 1.0]])
    s2 = np.array([[0.5, -0.3], [-0.3, 1.5]])
    assert not np.allclose(s1 @ s2, s2 @ s1)
    tr_sqrt = math.sqrt(np.trace(s1 @ s2) + 2 * math.sqrt(np.linalg.det(s1) * np.linalg.det(s2)))
    mu1, mu2 = np.array([1.0, -2.0]), np.array([0.5, 0.0])
    expected = np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * tr_sqrt
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, rel=1e-12)
    assert frechet_distance(mu2, s2, mu1, s1) == pytest.approx(expected, rel=1e-12)  # symmetric


def test_singular_covariances_and_rotation_invariance():
    """Rank-deficient covariances (fewer samples than dimensions) stay finite and exact; rotating both
    Gaussians by one orthogonal matrix does not change the distance."""
    rng = np.random.default_rng(2)
    s1, s2 = _random_cov(rng, 20, rank=5), _random_cov(rng, 20, rank=7)
    mu1, mu2 = rng.standard_normal(20), rng.standard_normal(20)
    d = frechet_distance(mu1, s1, mu2, s2)
    q, _ = np.linalg.qr(rng.standard_normal((20, 20)))
    assert np.isfinite(d) and d > 0
    assert frechet_distance(q @ mu1, q @ s1 @ q.T, q @ mu2, q @ s2 @ q.T) == pytest.approx(d, rel=1e-9)
    r = sqrtm_psd(s1)
    np.testing.assert_allclose(r @ r, s1, atol=1e-12)


def test_streaming_statistics_equal_numpy_for_any_batch_split():
    rng = np.random.default_rng(3)
    # float32 features (as networks give them) with a large mean: the naive sum-of-squares formula loses digits.
    x = (rng.standard_normal((1000, 12)) * 3 + 1e3).astype(np.float32)
    want_cov = np.cov(x.astype(np.float64), rowvar=False)
    for batch in (1000, 333, 64, 7):
        stats = FeatureStats(12)
        for s in range(0, len(x), batch):
            stats.update(torch.from_numpy(x[s:s + batch]))
        mu, cov = stats.mean_cov()
        np.testing.assert_allclose(mu, x.astype(np.float64).mean(0), rtol=1e-12)
        np.testing.assert_allclose(cov, want_cov, rtol=1e-9, atol=1e-9)


def test_sampled_gaussians_converge_to_the_exact_distance():
    """FID estimated from 200,000 samples per side (streamed in batches) is near the exact distance."""
    rng = np.random.default_rng(4)
    d = 6
    mu1, mu2 = np.zeros(d), np.full(d, 0.5)
    s1, s2 = _random_cov(rng, d) + 0.1 * np.eye(d), _random_cov(rng, d) + 0.1 * np.eye(d)
    exact = frechet_distance(mu1, s1, mu2, s2)
    g = torch.Generator().manual_seed(0)
    stats = []
    for mu, s in ((mu1, s1), (mu2, s2)):
        fs = FeatureStats(d)
        chol = torch.from_numpy(np.linalg.cholesky(s))
        for _ in range(20):
            fs.update(torch.randn(10_000, d, generator=g, dtype=torch.float64) @ chol.T + torch.from_numpy(mu))
        stats.append(fs.mean_cov())
    estimate = frechet_distance(*stats[0], *stats[1])
    assert estimate == pytest.approx(exact, rel=0.02)


def test_frechet_distance_is_invariant_to_sample_order():
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((500, 10)), rng.standard_normal((400, 10)) + 0.3
    d = frechet_distance(*mean_cov(a), *mean_cov(b))
    d_perm = frechet_distance(*mean_cov(a[rng.permutation(500)]), *mean_cov(b[rng.permutation(400)]))
    assert d_perm == pytest.approx(d, rel=1e-10)


def test_mismatched_statistics_are_refused():
    with pytest.raises(ValueError, match="mismatched"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))
    with pytest.raises(ValueError, match="at least 2"):
        FeatureStats(3).mean_cov()


def test_knn_radii_exclude_the_point_itself():
    x = torch.tensor([[0.0], [1.0], [3.0], [6.0], [10.0]], dtype=torch.float64)
    # 1-NN distances: 1, 1, 2, 3, 4; 2-NN: 3, 2, 3, 4, 7
    assert knn_radii(x, k=1).tolist() == [1.0, 1.0, 2.0, 3.0, 4.0]
    assert knn_radii(x, k=2, chunk=2).tolist() == [3.0, 2.0, 3.0, 4.0, 7.0]


def test_precision_recall_on_known_sets():
    rng = np.random.default_rng(6)
    real = rng.standard_normal((400, 4))
    same = precision_recall(real, real)
    assert same["precision"] == 1.0 and same["recall"] == 1.0 and same["k"] == 3
    # Samples collapsed onto a small part of the real data: precise, but they cover little of it.
    collapsed = real[:20] + 1e-3 * rng.standard_normal((20, 4))
    pr = precision_recall(real, np.repeat(collapsed, 20, axis=0))
    assert pr["precision"] == 1.0 and pr["recall"] < 0.2
    # Samples far away from the data: neither.
    far = precision_recall(real, real + 100.0)
    assert far["precision"] == 0.0 and far["recall"] == 0.0


def test_class_coverage():
    balanced = class_coverage(np.repeat(np.arange(10), 5), 10)
    assert balanced["classes_present"] == 1.0
    assert (balanced["entropy_ratio"] == pytest.approx(1.0)
            and balanced["kl_to_uniform"] == pytest.approx(0.0, abs=1e-12))
    collapsed = class_coverage(np.full(50, 3), 10)
    assert collapsed["classes_present"] == 0.1 and collapsed["entropy_ratio"] == 0.0
    assert collapsed["kl_to_uniform"] == pytest.approx(math.log(10))
    assert collapsed["label_histogram"] == [0, 0, 0, 50, 0, 0, 0, 0, 0, 0]
