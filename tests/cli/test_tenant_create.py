"""`hmi tenant create` against a live server: the adapter's kind and size options reach the
tenant's spec, and an option of another kind is refused before anything is sent."""

import json

import pytest

from hmi.cli import main
from hmi.client import Client
from tests.helpers.servers import ADMIN, TAGS, TRAIN, running_tiny_server


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    train = tmp_path_factory.mktemp("data") / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in TRAIN))
    tags = train.with_name("tags.jsonl")
    tags.write_text("".join(json.dumps(r) + "\n" for r in TAGS))
    with running_tiny_server(tmp_path_factory.mktemp("home")) as url:
        yield {"url": url, "train": str(train), "tags": str(tags)}


def create(live, name, *options):
    return main(["tenant", "create", name, "--url", live["url"], "--token", ADMIN, "--train", live["train"],
                 "--labels", "neg,pos", "--epochs", "1", "--wait", *options])


def test_lora_rank_and_alpha_reach_the_tenants_spec(live):
    assert create(live, "lora16", "--kind", "lora", "--rank", "16", "--alpha", "16") == 0
    spec = Client(live["url"], ADMIN).tenant("lora16")["spec"]
    assert (spec["kind"], spec["rank"], spec["alpha"]) == ("lora", 16, 16.0)


def test_lora_on_every_linear_layer_reaches_the_tenants_spec_and_serves(live):
    assert create(live, "lora-all", "--kind", "lora", "--targets", "all") == 0
    client = Client(live["url"], ADMIN)
    assert client.tenant("lora-all")["spec"]["targets"] == ["q", "k", "v", "ffn_in", "ffn_out"]
    assert client.infer("lora-all", ["a fine film"])[0]["label"] in ("neg", "pos")


def test_a_tagging_tenant_without_a_kind_gets_lora_on_every_linear_layer_and_a_classifier_the_bottleneck(live):
    tags = ["--type", "tagging", "--train", live["tags"], "--labels", "D,N,V"]
    assert create(live, "tagger", *tags) == 0
    client = Client(live["url"], ADMIN)
    spec = client.tenant("tagger")["spec"]
    assert (spec["kind"], spec["rank"], spec["targets"]) == ("lora", 16, ["q", "k", "v", "ffn_in", "ffn_out"])
    assert create(live, "plain") == 0
    assert client.tenant("plain")["spec"]["kind"] == "bottleneck"
    with pytest.raises(SystemExit, match="--reduction-factor applies to --kind bottleneck, not lora .the default for --type tagging"):
        create(live, "mistaken", *tags, "--reduction-factor", "4")


def test_bottleneck_reduction_factor_reaches_the_tenants_spec(live):
    assert create(live, "wide", "--reduction-factor", "4") == 0
    spec = Client(live["url"], ADMIN).tenant("wide")["spec"]
    assert (spec["kind"], spec["reduction_factor"]) == ("bottleneck", 4)


def test_a_size_option_of_another_kind_is_refused_before_anything_is_sent(live):
    with pytest.raises(SystemExit, match="--rank applies to --kind lora, not bottleneck"):
        create(live, "mistaken", "--rank", "16")
    with pytest.raises(SystemExit, match="--reduction-factor applies to --kind bottleneck, not ia3"):
        create(live, "mistaken", "--kind", "ia3", "--reduction-factor", "4")
    with pytest.raises(SystemExit, match="--targets applies to --kind lora, not bottleneck"):
        create(live, "mistaken", "--targets", "all")
    assert "mistaken" not in {t["name"] for t in Client(live["url"], ADMIN).tenants()}


def test_unlabeled_texts_from_a_file_reach_a_distilled_job_and_a_missing_file_is_refused_before_anything_is_sent(
        live, tmp_path):
    texts = tmp_path / "unlabeled.txt"
    texts.write_text("a great evening\n\nan awful evening\n")
    assert create(live, "taught", "--unlabeled", str(texts), "--distil") == 0
    client = Client(live["url"], ADMIN)
    job = next(j for j in client.jobs() if j["tenant"] == "taught")
    assert job["metrics"]["distilled"]["unlabeled_texts"] == 2
    assert create(live, "untaught", "--no-distil") == 0
    assert "distilled" not in next(j for j in client.jobs() if j["tenant"] == "untaught")["metrics"]
    with pytest.raises(SystemExit, match="nor a file"):
        create(live, "mistaken", "--unlabeled", str(tmp_path / "missing.txt"))
    assert "mistaken" not in {t["name"] for t in client.tenants()}


def test_a_training_file_that_is_missing_or_not_json_lines_is_refused_with_its_name_and_line_before_anything_is_sent(
        live, tmp_path):
    def create_from(train):
        return main(["tenant", "create", "mistaken", "--url", live["url"], "--token", ADMIN, "--train", str(train),
                     "--labels", "neg,pos"])
    with pytest.raises(SystemExit, match=r"cannot read .*missing\.jsonl: No such file"):
        create_from(tmp_path / "missing.jsonl")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "good", "label": "pos"}\n\n{"text": "bad", "label": \n')
    with pytest.raises(SystemExit, match=r"broken\.jsonl line 3 is not a JSON object"):
        create_from(broken)
    assert "mistaken" not in {t["name"] for t in Client(live["url"], ADMIN).tenants()}


def test_hold_out_reaches_the_job_and_is_refused_with_a_dataset_before_anything_is_sent(live):
    assert create(live, "held", "--hold-out", "2", "--no-distil") == 0
    client = Client(live["url"], ADMIN)
    job = next(j for j in client.request("GET", "/v1/jobs")["jobs"] if j["tenant"] == "held")
    assert (job["metrics"]["dev_held_out"], job["metrics"]["train"]["n"]) == (2, len(TRAIN) - 2)
    with pytest.raises(SystemExit, match="--hold-out goes with --train"):
        main(["tenant", "create", "dataset-held", "--url", live["url"], "--token", ADMIN, "--dataset", "news-topic",
              "--hold-out", "5"])
    assert "dataset-held" not in {t["name"] for t in client.tenants()}
