"""What a trained run says: metrics, probes, the test split's features, diagnostics, report, ArviZ, load_run.

Modules: arviz_export, diagnostics, dimensions, heldout, matched, metrics, probe, report, run."""
