"""What a trained run says: metrics, probes, diagnostics, figures, report and comparisons.

Also the test split's features, the ArviZ export, load_learner and load_run, and the weights as plain state_dicts.

Modules: arviz_export, comparison, comparison_figures, dci, design, diagnostics, dimensions, figures, heldout, loading,
matched, metrics, novelty, pairing, probe, report, run, stats, verdict, weights.
"""
