"""What a trained run says, and several runs side by side.

The modules, in the order the evidence flows from a checkpoint to a verdict, then the views of one run:

    loading          a run folder's checkpoint as a learner
    heldout          the test split's features (one pass of the backbone) and one run's evaluation: eval.json
    metrics          a representation's figures: the paper's consistency, the top-N one, sparsity, retrieval
    probe, dci       the linear probe and kNN on backbone features; DCI against known factors
    keys             eval.json's keys: a metric's name and the representation it was measured on
    matched          one gated run's controls, as sparse as F, and its posterior's representations
    diagnostics      the training's gradient conflict per dimension, and gate degeneracy
    novelty          scores of images unlike the training data, and how well each flags them
    stats, design    what a few seeds' paired differences allow one to say; the design declared before any run
    pairing          each gated run beside its baselines of the same seed: the rows a verdict reads
    comparison       the runs side by side: comparison.json and comparison.md (its figures: comparison_figures)
    verdict          the ten-seed result a single run is read beside
    dimensions       a run's numbers per dimension and its gate posterior, which figures (inspect_gates.py's) and
                     report (the HTML page) show; arviz_export writes the posterior as ArviZ data
    run, weights     load_run, a run folder as an object; its weights as plain state_dicts

Which runs a comparison trains, and what its records keep, is ``train/plan.py``'s.
"""
