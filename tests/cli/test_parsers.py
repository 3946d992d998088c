"""Every script's command line: whole flag names only, and a typo is one line naming the flag meant."""

import pytest

from bayesncl_pyro.cli import bench_report, compare, export, gate_gradient_bias, inspect_gates, report, run_svi

MAINS = [run_svi.main, compare.main, inspect_gates.main, report.main, export.main, gate_gradient_bias.main,
         bench_report.main]


def test_an_abbreviated_flag_is_refused_naming_the_whole_one(capsys):
    with pytest.raises(SystemExit) as stop:
        run_svi.config(["--max-step", "20"])  # argparse's prefix matching ran this as --max-steps 20
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-step: did you mean --max-steps?" in err and "usage:" not in err


@pytest.mark.parametrize("main", MAINS, ids=lambda m: m.__module__.rsplit(".", 1)[1])
def test_a_typo_is_one_line_with_the_closest_flag(main, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["run", "--helpp"])  # a positional for the scripts that need one: checked before unknown flags
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "did you mean --help?" in err


def test_run_svi_suggests_the_gate_density(capsys):
    with pytest.raises(SystemExit):
        run_svi.main(["--gate-densty", "0.3"])
    assert "--gate-densty: did you mean --gate-density?" in capsys.readouterr().err
