import subprocess
import sys
from pathlib import Path

import pytest

from hmi.cli import build_parser, main
from hmi.cli.roots import parse_selection


def test_every_subcommand_has_help():
    parser = build_parser()
    for argv in (["data", "prepare"], ["calibrate"], ["prepare", "--decoder"], ["plot", "build"], ["plot", "stats", "x"],
                 ["plot", "learn-backoff"],
                 ["serve"], ["info"],
                 ["demo"], ["infer", "t", "x"], ["tenant", "list"], ["jobs"], ["domain", "list"],
                 ["domain", "create", "d", "--corpus", "legal"],
                 ["domain", "create", "d", "--corpus", "legal", "--root", "mpnet-base", "--l-low", "6"]):
        assert parser.parse_args(argv).func


def test_a_domain_command_through_a_server_refuses_a_root_named_beside_it(capsys):
    """``--root`` chooses the local home's tree of domains; a server serves its own root's, so naming
    one with ``--url`` is refused before anything is sent (nothing listens at that address)."""
    assert main(["domain", "list", "--url", "http://127.0.0.1:9", "--root", "mpnet-base"]) == 2
    assert "through a server (--url) the server's root serves them" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["domain", "list"], ["plot", "learn-backoff"], ["domain", "create", "d", "--corpus", "legal"]])
def test_a_root_fetched_on_first_use_is_not_fetched_by_a_command_that_needs_it_calibrated(argv, capsys, monkeypatch):
    """In a home that has not calibrated mpnet-base, a command that needs its calibrated artifact says
    how to make one at once, instead of first fetching the root (about 400 MB) to say so."""
    import hmi.model.catalog as catalog
    from hmi.home import hmi_home

    def fetched(*_a, **_kw):
        raise AssertionError("the root was fetched")
    monkeypatch.setattr(catalog, "fetch_mpnet", fetched)
    with pytest.raises(SystemExit, match=r"no calibrated root yet: run `hmi calibrate --root mpnet-base --l-low 4` first"):
        main([*argv, "--root", "mpnet-base", "--l-low", "4"])
    assert not (hmi_home() / "models" / "mpnet-base").exists()


def test_console_script_prints_help():
    script = Path(sys.executable).with_name("hmi")
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    assert "calibrate" in out.stdout and "serve" in out.stdout


@pytest.mark.parametrize("argv", [["--help"], ["tenant", "create", "--help"], ["infer", "--help"], ["jobs", "--help"],
                                  ["generate", "--help"], ["data", "--help"]])
def test_help_and_client_commands_leave_the_model_side_unloaded(argv):
    """Only the group of the command that runs is imported: help and the client commands start in
    a fraction of a second, without torch."""
    code = f"import sys\nfrom hmi.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n" \
           "print('torch' in sys.modules, file=sys.stderr)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.strip().splitlines()[-1] == "False"


def test_info_without_artifact_says_what_to_do(capsys):
    assert main(["info"]) == 0
    assert "hmi calibrate" in capsys.readouterr().out


def test_calibrate_refuses_non_positive_settings_before_any_work():
    for argv in (["--steps", "0"], ["--lr", "-1"], ["--batch-size", "0"], ["--max-minutes", "0"]):
        with pytest.raises(SystemExit, match="must be positive"):
            main(["calibrate", *argv])


def test_calibrate_refuses_an_unknown_corpus_and_a_corpus_for_the_decoder_before_any_work():
    with pytest.raises(SystemExit, match="--corpus 'news,poetry': use all, or prepared corpus names"):
        main(["calibrate", "--corpus", "news,poetry"])
    with pytest.raises(SystemExit, match="--corpus is for encoder roots"):
        main(["calibrate", "--decoder", "--corpus", "all"])


def test_decoder_commands_refuse_an_encoder_root_before_any_work():
    """``--root`` (and ``--l-low`` where only the decoder's shipped split is served) would name an
    encoder root that ``--decoder`` ignores: refused before data, models or PLOTs are touched."""
    for command in (["prepare"], ["plot", "build"]):
        for argv in (["--root", "mpnet-base"], ["--l-low", "4"]):
            with pytest.raises(SystemExit, match=f"hmi {' '.join(command)}: --decoder works on the decoder root"):
                main([*command, "--decoder", *argv])
    with pytest.raises(SystemExit, match="hmi calibrate: --decoder works on the decoder root.*--root names"):
        main(["calibrate", "--decoder", "--root", "mpnet-base"])


def test_selection_parsing_and_errors():
    assert parse_selection("alpha:0.5").alpha == 0.5
    assert parse_selection("top_k:10").top_k == 10
    with pytest.raises(SystemExit, match="bad --select"):
        parse_selection("alpha:lots")
    with pytest.raises(SystemExit, match="bad --select"):
        parse_selection("most")


def test_client_commands_report_an_unreachable_server(capsys):
    assert main(["infer", "--url", "http://127.0.0.1:9", "t", "hello"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_serve_ray_refuses_settings_it_cannot_honour_before_any_work(capsys):
    from hmi.cli import main

    assert main(["serve", "--ray", "--replicas", "0"]) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err
    assert main(["serve", "--ray", "--hgpt"]) == 2
    assert "--hgpt is not served through --ray" in capsys.readouterr().err
    assert main(["serve", "--ray", "--job-cpus", "0"]) == 2
    assert "--job-cpus must be above 0" in capsys.readouterr().err
    assert main(["serve", "--ray", "--registry", "actor", "--registry-cache-s", "-1"]) == 2
    assert "--registry-cache-s must be 0 or more" in capsys.readouterr().err


def test_info_says_when_an_artifact_of_an_earlier_time_budget_holds_fewer_steps_and_how_to_run_them_all(capsys):
    import json

    from hmi.home import hmi_home
    from hmi.io import atomic_write_text

    roots = hmi_home() / "roots"
    for aid, extra in (("minilm-l3-cut", {}), ("minilm-l3-planned", {"steps_planned": 412})):
        (roots / aid).mkdir(parents=True)
        cal = {"steps": 600, "steps_done": 412, "max_minutes": 30.0, "lr": 5e-4, "batch_size": 32,
               "train_seconds": 1800.0, **extra}
        (roots / aid / "config.json").write_text(json.dumps({"root": "minilm-l6", "l_low": 3, "hidden_size": 384,
                                                              "calibration": cal}))
        atomic_write_text(roots / "current", aid)
        assert main(["info"]) == 0
        out = capsys.readouterr().out
        assert "held 412 of the 600 steps" in out
        assert ("decayed over those" in out) == bool(extra)  # a planned run says what its shortened schedule cost
        assert "the whole recipe (continuing from the run's checkpoint" in out.lower()
        assert "`hmi calibrate --l-low 3`" in out
        assert "`--miss-policy auto` serves: backoff" in out  # no root PLOT, no learned back-off shipped for it


def test_serve_refuses_bf16_upper_layers_on_a_device_that_would_not_run_them_faster(capsys, monkeypatch):
    from hmi.cli import main
    from hmi.scheduler import pipeline

    monkeypatch.setattr(pipeline, "NATIVE_BF16", False)  # a CPU without avx512_bf16 or amx_bf16
    assert main(["serve", "--device", "cpu", "--upper-precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "bf16 runs on CPUs that multiply bf16 natively" in err and "use fp32" in err


def test_a_plot_builds_corpus_argument_reads_prepared_corpora_joined_or_all_or_a_file(tmp_path):
    from hmi.cli.common import read_corpus_arg
    from hmi.data import corpus_texts, load_corpus

    assert read_corpus_arg("news") == load_corpus("news")
    assert read_corpus_arg("news,software") == load_corpus("news") + load_corpus("software")
    assert len(read_corpus_arg("all")) == len(corpus_texts("all"))
    (tmp_path / "mine.txt").write_text("one line\n\n  another  \n")
    assert read_corpus_arg(str(tmp_path / "mine.txt")) == ["one line", "another"]
    with pytest.raises(SystemExit, match="neither a prepared corpus"):
        read_corpus_arg("news,poetry")


def test_info_says_what_the_root_plot_holds_and_what_it_was_built_from(capsys):
    import json

    from hmi.home import hmi_home
    from hmi.io import atomic_write_text
    from hmi.model.hplm import WindowedEncoder
    from hmi.model.root import default_spec, load_tokenizer
    from hmi.plot.build import Selection, build_from_corpus
    from hmi.plot.store import PlotMeta, PlotStore
    from tests.conftest import tiny_bert

    aid, roots = "minilm-l3-tiny", hmi_home() / "roots"
    (roots / aid).mkdir(parents=True)
    (roots / aid / "config.json").write_text(json.dumps({"root": "minilm-l6", "l_low": 3, "hidden_size": 32}))
    atomic_write_text(roots / "current", aid)
    main(["info"])
    assert "root PLOT: none yet (`hmi prepare`" in capsys.readouterr().out
    tok = load_tokenizer(default_spec().model_dir)
    store = PlotStore(hmi_home() / "plots" / aid / "root", meta=PlotMeta(root_artifact=aid, l_low=3, hidden_size=32),
                      readonly=False)
    build_from_corpus(store, WindowedEncoder(tiny_bert(hidden=32, vocab=len(tok)), 3).eval(), tok,
                      ["the cat sat on the mat"], Selection("all"), with_backoff=False, progress=False, corpus="all")
    n = len(store)
    store.close()
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"({n:,} n-grams, " in out and "built from the corpus 'all'" in out
    assert "learned back-off: none (`hmi prepare` trains it where `auto` serves one; `hmi plot learn-backoff`)" in out
    assert "`--miss-policy auto` serves: backoff" in out
