"""The speed benchmark script runs and prints every row (timings are printed, never asserted)."""

from analysis.speed import main


def test_speed_script_prints_ratios_for_each_method(capsys):
    main(["--shape", "mid", "--layers", "2", "--repeats", "1", "--methods", "hap", "random",
          "--retain", "0.5", "--groups", "2", "--text-tokens", "12"])
    out = capsys.readouterr().out
    assert "first_layers=0" in out and "text only" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["hap"], ["random"])]
    assert [r[0] for r in rows] == ["hap", "random"]
    assert all(float(r[4]) > 0 and float(r[5]) > 1 for r in rows)  # measured and ideal speed-ups
    assert rows[0][-1].endswith("%")  # HAP's scoring overhead against the same schedule without scoring
