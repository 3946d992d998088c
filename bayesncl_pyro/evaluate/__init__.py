"""What a trained run says: metrics, probes, the test split's features, diagnostics, report, ArviZ, load_run, the
weights as plain state_dicts, and several runs compared.

Modules: arviz_export, comparison, diagnostics, dimensions, heldout, matched, metrics, probe, report, run, weights."""
