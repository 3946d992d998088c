"""What a trained run says, and several runs side by side.

The modules, in the order the evidence flows from a checkpoint to a verdict, then the views of one run:

    loading            a run folder's checkpoint as a learner
    heldout            the test split's features (one pass of the backbone) and one run's evaluation: eval.json
    metrics            a representation's figures: the paper's consistency, the top-N one, sparsity, retrieval
    probe, dci         the linear probe and kNN on backbone features; DCI against known factors
    keys               eval.json's keys: a metric's name and the representation it was measured on
    matched            one gated run's controls, as sparse as F, and its posterior's representations
    diagnostics        the training's gradient conflict per dimension, and gate degeneracy
    novelty_scores     scores of images unlike the training data, one per image: the posterior's, deterministic ones
    novelty_controls   gating heads fitted on the run's frozen backbone, which the posterior's scores are read beside
    novelty_detection  how well each score flags each novel set: eval.json's novelty
    stats, design      what a few seeds' paired differences allow one to say; the design declared before any run
    pairing            each gated run beside its baselines of the same seed: the rows a verdict reads
    novelty            the novelty question declared before any run, paired by seed, and its part of comparison.md
    comparison         the runs side by side: comparison.json and comparison.md (its figures: comparison_figures)
    verdict            the ten-seed result a single run is read beside
    dimensions         a run's numbers per dimension, which the figures and the report both read
    posterior          its gate posterior on the test split; arviz_export writes it as ArviZ data
    figures            inspect_gates.py's figures and summary (novelty_figures: the novelty scores' ROC curves)
    report_data        everything the HTML report shows: report.json
    report             the HTML page of report.json (write_report, Report)
    run, weights       load_run, a run folder as an object; its weights as plain state_dicts

Which runs a comparison trains, and what its records keep, is ``train/plan.py``'s.
"""
