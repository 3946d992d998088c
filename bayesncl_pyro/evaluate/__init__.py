"""What a trained run says: metrics, probes, the test split's features, diagnostics, figures, report, ArviZ,
load_learner and load_run, the weights as plain state_dicts, and several runs compared.

Modules: arviz_export, comparison, diagnostics, dimensions, figures, heldout, loading, matched, metrics, probe, report,
run, weights."""
