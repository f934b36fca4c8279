"""fastddpm.eval: how good are the samples? FID, precision/recall and class coverage, fast and labelled.

Module map: frechet (the Frechet distance, streaming mean/covariance in float64) ; precision_recall (k-NN
manifolds, class coverage) ; classifier (the in-tool feature network, trained once per dataset and cached) ;
inception (Inception-v3 from a local weights file) ; features (which feature space, the real data's cached
statistics) ; evaluate (sample -> features -> scores) ; during_training (`train --eval-every`) ; curve (the
FID-vs-time PNG) ; cli (`fastddpm eval`).
"""
