"""The decoder's calibrated windows ship with the package like the encoder's: installed only for
the decoder they were calibrated on and only when intact, so that ``hmi serve --hgpt`` needs no
calibration on a first start; and a fine-tune worker reads the calibrated windows too."""

import copy
import json
import shutil

import pytest
import torch

from hmi.model.artifact import ArtifactMismatchError
from hmi.training.calibrate_decoder import (
    find_shipped_decoder,
    install_shipped_decoder,
    load_calibrated_decoder,
    save_decoder_artifact,
)
from tests.helpers.decoders import tiny_decoder


def shipped_tiny(tmp_path, root):
    """Calibrated-looking windows of ``root`` shipped in ``tmp_path/shipped``; their folder name."""
    lower = copy.deepcopy(root.layers[:root.l_low])
    with torch.no_grad():
        lower[0].mlp.down_proj.weight.add_(0.5)
    from hmi.model.root import weights_fingerprint

    name = save_decoder_artifact(root, lower, {"root_fingerprint": weights_fingerprint(root.model)}, tmp_path / "build")
    folder = f"{name}-l{root.l_low}"
    shutil.copytree(tmp_path / "build" / "roots" / folder, tmp_path / "shipped" / folder)
    return folder, lower


def test_shipped_decoder_windows_are_installed_only_for_their_decoder_and_split_and_only_when_intact(tmp_path):
    root = tiny_decoder()
    folder, lower = shipped_tiny(tmp_path, root)
    shipped = tmp_path / "shipped"
    other = tiny_decoder()
    with torch.no_grad():
        other.model.model.embed_tokens.weight.add_(1.0)
    assert install_shipped_decoder(tmp_path / "a", other, shipped) is None  # another decoder: nothing fits
    assert install_shipped_decoder(tmp_path / "a", tiny_decoder(l_low=3), shipped) is None  # another split
    assert not (tmp_path / "a" / "roots" / "current_decoder").exists()
    assert install_shipped_decoder(tmp_path / "b", root, shipped) == folder.rsplit("-l", 1)[0]
    loaded = load_calibrated_decoder(tmp_path / "b", tiny_decoder())
    assert loaded.artifact_id == folder
    assert all(torch.equal(a, b) for a, b in zip(loaded.window_layers.state_dict().values(), lower.state_dict().values()))
    (shipped / folder / "lower.safetensors").write_bytes(b"damaged")
    with pytest.raises(ArtifactMismatchError, match="damaged"):
        install_shipped_decoder(tmp_path / "c", root, shipped)


@pytest.mark.slow
def test_the_packaged_decoder_finds_its_shipped_windows_and_a_fresh_home_installs_them_without_calibrating(
        tmp_path, capsys, decoder_copy_home):
    """``hmi plot build --decoder`` on a fresh home installs the shipped windows (it used to ask for
    ``hmi calibrate --decoder``, minutes of work the package had already done) and builds the PLOT."""
    pytest.importorskip("gguf")
    from hmi.bootstrap import prepare_decoder
    from hmi.cli import main
    from hmi.home import hmi_home
    from hmi.model.decoder import DecoderNotFoundError, load_decoder
    from hmi.plot.store import PlotStore
    from tests.helpers.shared import link_home

    link_home(decoder_copy_home, hmi_home())  # the fp32 copy is another test's subject
    try:
        decoder = load_decoder(l_low=2)
    except DecoderNotFoundError as exc:
        pytest.skip(str(exc))
    folder = find_shipped_decoder(decoder)
    assert folder is not None, "no shipped windows fit the installed decoder: run hmi calibrate --decoder and ship them"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["quality"]["ppl_calibrated"] < meta["quality"]["ppl_naive_window"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The court held that the contract was void.\nThe appeal was dismissed.\n")
    assert main(["plot", "build", "--decoder", "--corpus", str(corpus), "--out", str(tmp_path / "plot")]) == 0
    out = capsys.readouterr().out
    assert "shipped with hmi" in out and "calibrating" not in out
    store = PlotStore(tmp_path / "plot", readonly=True)
    assert store.meta.root_artifact == folder.name and store.stats()["entries"] > 0
    store.close()
    again = prepare_decoder(hmi_home())  # the next start finds it installed
    assert again.artifact_id == folder.name and "shipped" not in capsys.readouterr().out


def test_a_fine_tune_worker_reads_the_calibrated_windows_not_the_decoders_own_layers(tmp_path):
    from hmi.hgpt.runtime import HgptRuntime
    from hmi.model.decoder import CausalLower
    from hmi.plot.store import PlotMeta, PlotStore
    from tests.helpers.decoders import tiny_decoder_root

    root = tiny_decoder_root()
    _, lower = shipped_tiny(tmp_path, root)
    root.windowed = lower
    meta = PlotMeta(root.artifact_id, 2, 32, n=1, kind="causal")
    PlotStore(tmp_path / "plot", meta=meta, readonly=False).close()
    runtime = HgptRuntime(root, PlotStore(tmp_path / "plot", readonly=True, expect=meta), None, miss_policy="compute")
    try:
        view = runtime.worker_view()
        assert view.root().window_layers is lower and view.root().artifact_id == root.artifact_id
        windows = torch.tensor([[5, 6, 7], [0, 8, 9]])
        served = runtime.lookup.chain[0].encoder.lower(windows)
        assert torch.equal(CausalLower(view.root()).lower(windows), served)
        assert not torch.equal(CausalLower(tiny_decoder_root()).lower(windows), served)  # the decoder's own layers differ
    finally:
        runtime.shutdown()


def test_a_homes_calibrated_decoders_are_found_by_split_newest_first_and_load_with_their_windows(tmp_path):
    import os

    from hmi.training.calibrate_decoder import decoder_folders, load_decoder_folder

    two, four = tiny_decoder(), tiny_decoder(l_low=3)
    made = {}
    for i, root in enumerate((two, two, four)):
        lower = copy.deepcopy(root.layers[:root.l_low])
        with torch.no_grad():
            lower[0].mlp.down_proj.weight.add_(0.1 * (i + 1))
        name = save_decoder_artifact(root, lower, {}, tmp_path)
        folder = tmp_path / "roots" / f"{name}-l{root.l_low}"
        os.utime(folder / "meta.json", (1000 + i, 1000 + i))
        made[i] = (folder, lower)
    assert decoder_folders(tmp_path, 2) == [made[1][0], made[0][0]]
    assert decoder_folders(tmp_path, 3) == [made[2][0]] and decoder_folders(tmp_path, 8) == []
    loaded = load_decoder_folder(made[0][0], tiny_decoder())
    assert loaded.l_low == 2 and loaded.artifact_id == made[0][0].name
    assert all(torch.equal(a, b) for a, b in zip(loaded.window_layers.state_dict().values(),
                                                 made[0][1].state_dict().values()))
