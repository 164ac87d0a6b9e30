"""The request bodies of the HTTP API, declared once.

Handlers validate bodies with these models, and ``/openapi.json`` is generated from the same
models, so the document and the server agree.  The limits come from the server's configuration.

Status policy: 400 for a body the document does not allow; 413 for a size limit (body bytes,
items, characters, examples, tokens); 422 for a body the document allows but that is
inconsistent in ways a schema cannot state (labels of the data missing from the task's labels,
a corpus too small for a domain, a prompt over the token limit is 413).
"""

from __future__ import annotations

import weakref
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from hmi.adapters.spec import ALL_LORA_SITES, HEADS, KINDS, LORA_SITES, POOLINGS
from hmi.data import CORPORA, TASKS
from hmi.dispatcher.validation import ApiError
from hmi.names import NAME_PATTERN
from hmi.training.objectives import DEFAULT_OBJECTIVE, OBJECTIVES, steps_help
from hmi.training.serving import AUTO_RULE, SERVING_MODES

SEED_LIMIT = 2**63
MAX_NEW_TOKENS = 1024
MAX_CORPUS_LINES = 1_000_000


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _integral(v):
    """JSON Schema counts 3.0 as an integer: such floats are taken as ints (strings and bools are not)."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**63 else v


Int = Annotated[int, BeforeValidator(_integral)]


def _no_default(schema: dict) -> None:
    schema.pop("default", None)


def Absent(**kw):  # noqa: N802 - reads as a type in the models
    """An optional field that may be left out but not sent as null (the document says so)."""
    return Field(None, json_schema_extra=_no_default, **kw)


# "Has a character other than ASCII white space", spelled as an explicit class: ``\S`` differs
# between the document's ECMA regexes and the validator's (U+0085 is white space to one only).
NON_BLANK = r"[^\t\n\v\f\r ]"
Name = Annotated[str, Field(pattern=f"^{NAME_PATTERN}$", description="1-63 characters a-z, 0-9, '_' or '-'")]
ROOT_MODEL = "root"  # the shared root's model name (POST /v1/embeddings): no tenant takes it


def _not_root(name: str) -> str:
    if name == ROOT_MODEL:
        raise PydanticCustomError("reserved_name", "'root' names the shared root model; choose another name")
    return name


TenantName = Annotated[str, Field(pattern=f"^{NAME_PATTERN}$", json_schema_extra={"not": {"const": ROOT_MODEL}},
                                  description="1-63 characters a-z, 0-9, '_' or '-'; not 'root'"),
                       AfterValidator(_not_root)]
Text = Annotated[str, Field(pattern=NON_BLANK, description="a text with at least one non-space character")]
NonEmpty = Annotated[str, Field(min_length=1)]


def one_of(*fields: str) -> dict:
    """The JSON schema of "exactly one of these fields"."""
    return {"oneOf": [{"required": [f]} for f in fields]}


def exactly_one(model: BaseModel, *fields: str) -> BaseModel:
    """Checks a validated model against ``one_of(*fields)`` (fields left out are None)."""
    if sum(getattr(model, f) is not None for f in fields) != 1:
        raise PydanticCustomError("missing_field", "give exactly one of {fields}", {"fields": ", ".join(map(repr, fields))})
    return model


class Adapter(Body):
    kind: Literal[KINDS] = Absent(  # type: ignore[valid-type]
        description="default: bottleneck for classification, LoRA of rank 16 on every linear layer for tagging")
    reduction_factor: Int = Absent(ge=1, le=4096)
    rank: Int = Absent(ge=1, le=256)
    alpha: float = Absent(gt=0, le=1e6)
    targets: Annotated[list[Literal[LORA_SITES + (ALL_LORA_SITES,)]],  # type: ignore[valid-type]
                       Field(min_length=1, max_length=len(LORA_SITES))] = Absent(
        description="lora: the projections it adapts, of q, k, v, ffn_in (the FFN's first layer) and ffn_out (its "
                    "second), or [\"all\"] (default [\"q\", \"v\"])")


class DecoderAdapter(Body):
    kind: Literal["lora"] = "lora"
    rank: Int = Absent(ge=1, le=256)
    alpha: float = Absent(gt=0, le=1e6)


class TextExample(Body):
    text: Text
    label: str


class TagExample(Body):
    tokens: list[NonEmpty] = Field(min_length=1)
    tags: list[str] = Field(min_length=1)


class DomainUpdate(Body):
    model_config = ConfigDict(json_schema_extra=one_of("corpus", "corpus_name"))
    corpus: Annotated[list[str], Field(min_length=1, max_length=MAX_CORPUS_LINES, description="one document per line")] = Absent()
    corpus_name: Literal[tuple(CORPORA)] = Absent()  # type: ignore[valid-type]
    max_lines: Int = Absent(ge=1, le=MAX_CORPUS_LINES)
    steps: Int = Absent(ge=1, le=5000, description=f"further-pretraining steps (default: {steps_help()})")
    objective: Literal[OBJECTIVES] = Field(  # type: ignore[valid-type]
        DEFAULT_OBJECTIVE, description="further pretraining: distill the full root on the domain's text, or the paper's MLM")

    @model_validator(mode="after")
    def _one_source(self):
        return exactly_one(self, "corpus", "corpus_name")


class DomainCreate(DomainUpdate):
    model_config = ConfigDict(json_schema_extra={**one_of("corpus", "corpus_name"),
                                                 "not": {"properties": {"name": {"const": "root"}}}})
    name: Name
    parent: Name = "root"
    alpha: float = Field(0.5, ge=0, le=1)


# What the encoder fields mean (the OpenAPI document's words).
POOLING_HELP = (
    "what a classification head reads: the [CLS] vector (cls) or the mean of the text's tokens; absent, each "
    "fine-tune with dev examples trains both at each of its learning rates and keeps the best on dev (without dev "
    "examples, given or held out: cls; on mpnet-base: mean, as its accuracy tables read)")
HOLD_OUT_HELP = (
    "without dev examples: how many training examples (drawn with a fixed seed) become the dev split that chooses "
    "the fine-tune's settings, its epoch and auto's serving (default 0: every example trains, at the first "
    "setting, for every epoch)")
UNLABELED_HELP = (
    "texts like those the tenant will be asked about, without labels: with the miss policy compute+insert the "
    "fine-tune keeps their windows in the domain's PLOT (with its training texts'), so they hit from the first "
    "request; with distil, the teacher answers them and the served adapter learns from those answers")


def _encoder_models(limits) -> list[type[BaseModel]]:
    class Task(Body):
        type: Literal[HEADS] = "classification"  # type: ignore[valid-type]
        labels: list[NonEmpty] = Field(min_length=2, max_length=limits.max_labels, json_schema_extra={"uniqueItems": True})
        pooling: Literal[POOLINGS] = Absent(description=POOLING_HELP)  # type: ignore[valid-type]

    Examples = list[TextExample | TagExample]

    class TrainingData(Body):
        train: Examples = Field(min_length=1, max_length=limits.max_examples)
        dev: Examples = Field([], max_length=limits.max_examples)
        hold_out: Int = Absent(ge=0, description=HOLD_OUT_HELP)
        test: Examples = Field([], max_length=limits.max_examples)
        unlabeled: list[Text] = Field([], max_length=limits.max_examples, description=UNLABELED_HELP)

    class EncoderUpdate(Body):
        model_config = ConfigDict(json_schema_extra=one_of("training_data", "dataset"))
        training_data: TrainingData = Absent()
        dataset: Literal[tuple(TASKS)] = Absent()  # type: ignore[valid-type]
        max_train: Int = Absent(ge=1)
        max_eval: Int = Absent(ge=1, description="with dataset: how many of its dev and test examples the job "
                               "evaluates (default 500)")
        epochs: Int = Field(4, ge=1, le=50)
        distil: bool = Absent(description=(
            "train a teacher first (the task's adapters in every layer of the full-context root) and train "
            "the served adapter on its answers as well as the labels, over the training texts and the "
            "unlabeled ones (training_data.unlabeled; with dataset, lines of its domain corpus, four per "
            "training text up to 2,000): "
            "more accurate as served, at several times the fine-tune's time; serving is unchanged "
            "(default: the server's, on unless `hmi serve --no-distil`)"))
        serving: Literal[SERVING_MODES] = Absent(description=(  # type: ignore[valid-type]
            "how the tenant is served: windows (the domain's PLOT and the adapter in the upper layers: "
            "the hPLM, fastest), whole (its distilled fine-tune's teacher: the full root with the adapter "
            f"in every layer, as slow as a plain adapter per text and as accurate), or auto ({AUTO_RULE}, else "
            "windows); whole needs "
            "distil, and auto without distil or dev examples (given or held out) stays on the windows (default: "
            "the server's, `hmi serve --serving`, auto unless changed)"))

        @model_validator(mode="after")
        def _one_source(self):
            return exactly_one(self, "training_data", "dataset")

    class EncoderTenant(EncoderUpdate):
        name: TenantName
        model: Literal["encoder"] = "encoder"
        domain: Name = "root"
        task: Task
        adapter: Adapter = Adapter()
        truncate: bool = Field(False, description="cut texts over the server's token limit (max_tokens) in training "
                               "and inference alike; by default they are refused (413), so that nothing is cut unseen")

    return [EncoderUpdate, EncoderTenant]


def _decoder_models(limits) -> list[type[BaseModel]]:
    class DecoderUpdate(Body):
        model_config = ConfigDict(json_schema_extra=one_of("corpus", "training_text"))
        corpus: Literal[tuple(CORPORA)] = Absent()  # type: ignore[valid-type]
        training_text: Annotated[list[Text], Field(min_length=1, max_length=limits.max_examples)] = Absent()
        max_train: Int = Absent(ge=1)
        epochs: Int = Field(1, ge=1, le=20)

        @model_validator(mode="after")
        def _one_source(self):
            return exactly_one(self, "corpus", "training_text")

    class DecoderTenant(DecoderUpdate):
        name: TenantName
        model: Literal["decoder"]
        adapter: DecoderAdapter = DecoderAdapter()

    class Sampling(Body):
        prompt: Annotated[str, Field(min_length=1, max_length=limits.max_input_chars)]
        temperature: float = Field(0.0, ge=0, le=10, description="below 0.001: greedy")
        top_p: float = Field(1.0, gt=0, le=1)
        seed: Int = Absent(ge=0, lt=SEED_LIMIT)
        stop: Annotated[list[NonEmpty], Field(max_length=8)] | NonEmpty = []
        stream: bool = False

    class GenerateBody(Sampling):
        max_new_tokens: Int = Field(32, ge=1, le=MAX_NEW_TOKENS)

    class CompletionBody(Sampling):
        model: Name = Field(description="the decoder tenant")
        max_tokens: Int = Field(32, ge=1, le=MAX_NEW_TOKENS)
        n: Literal[1] = 1
        user: str = Absent()

    return [DecoderUpdate, DecoderTenant, GenerateBody, CompletionBody]


_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def models_of(server) -> dict[str, type[BaseModel]]:
    """The request models of a server's limits (``server.cfg``), built on first use and kept
    while the server lives."""
    models = _MODELS.get(server)
    if models is None:
        models = _MODELS[server] = build_models(server.cfg)
    return models


def build_models(limits) -> dict[str, type[BaseModel]]:
    """The body models of every route, with the limits of ``limits`` (a ServerConfig: max_inputs,
    max_input_chars, max_examples, max_labels), by class name."""

    EmbeddingText = Annotated[str, Field(pattern=NON_BLANK, max_length=limits.max_input_chars)]

    class InferBody(Body):
        inputs: list[Annotated[str, Field(pattern=NON_BLANK, max_length=limits.max_input_chars)]] = Field(
            min_length=1, max_length=limits.max_inputs)
        truncate: bool = Absent(description="cut inputs over the token limit (their answer says \"truncated\": "
                                "true) instead of refusing them (413); default: the tenant's setting")

    class EmbeddingBody(Body):
        model: Annotated[str, Field(pattern=f"^{NAME_PATTERN}$")] = Field(
            description="'root' (the shared root model: any valid token) or an encoder tenant's name (its token or the "
                        "admin's): the upper layers run with that tenant's adapter")
        input: EmbeddingText | Annotated[list[EmbeddingText], Field(min_length=1, max_length=limits.max_embedding_inputs)]
        encoding_format: Literal["float", "base64"] = Field(
            "float", description="base64: each embedding's float32 values, little-endian, base64-encoded")
        dimensions: Int = Absent(ge=1, description="the embedding's width; this server serves the root's width only")
        user: str = Absent()
        truncate: bool = Absent(description="cut inputs over the token limit instead of refusing them (413); "
                                "not in OpenAI's API; default: refuse (or the tenant's setting)")

    class ShareBody(Body):
        weight: float = Field(gt=0, le=1000, description="the tenant's share of the batches relative to the others "
                              "(default 1: equal shares)")

    class PrivateTenant(Body):
        name: TenantName
        model: Literal["private"] = Field(description="a private tenant: its adapter stays on its own side "
                                          "(hmi.split); the server runs the root's frozen layers for it")

    models = [InferBody, EmbeddingBody, ShareBody,
              DomainUpdate, DomainCreate, PrivateTenant, *_encoder_models(limits), *_decoder_models(limits)]
    return {m.__name__: m for m in models}


# What a too-long list or a blank item is called, per field.
_TOO_MANY = {"inputs": "too_many_inputs", "input": "too_many_inputs", "train": "too_many_examples", "dev": "too_many_examples",
             "test": "too_many_examples", "training_text": "too_many_examples", "corpus": "too_many_lines"}
_EMPTY = {"inputs": "empty_inputs", "input": "empty_input", "train": "empty_training_data", "training_text": "empty_training_data",
          "corpus": "empty_corpus"}
_UNKNOWN = {"dataset": "unknown_dataset", "corpus": "unknown_corpus", "corpus_name": "unknown_corpus"}
# Out-of-range values of generation fields keep the codes the generation engine uses.
_BAD_VALUE = {"prompt": "bad_prompt", "max_new_tokens": "bad_max_new_tokens", "max_tokens": "bad_max_new_tokens",
              "temperature": "bad_temperature", "top_p": "bad_top_p", "seed": "bad_seed", "stop": "bad_stop"}


def _branch(part: str) -> bool:
    """Whether a location part names a branch of a union (TextExample, list[constrained-str], ...)."""
    return part[:1].isupper() or "[" in part or part.startswith("constrained-") or part in ("str", "int", "list")


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _branch(part):
            continue
        else:
            out += ("." if out else "") + part
    return out


def api_error(exc: ValidationError) -> ApiError:
    """The first problem of a ValidationError as the API's error: status, code and a message
    naming the field."""
    errors = exc.errors()
    err = errors[0]
    if err["type"].endswith("_type"):  # a union: report the branch the value was meant for, not the wrong type
        err = next((e for e in errors if e["loc"][:1] == err["loc"][:1] and not e["type"].endswith("_type")), err)
    t, loc = err["type"], tuple(err["loc"])
    names = [p for p in loc if isinstance(p, str) and not _branch(p)]
    field, where = (names[-1] if names else ""), _where(loc)
    in_example = any(p in ("train", "dev", "test") for p in names) and any(isinstance(p, int) for p in loc)
    if in_example and t not in ("too_long",):
        return ApiError(400, "invalid_example", f"{where.rsplit('.', 1)[0] if '.' in where else where}: each example "
                        "needs 'text' (a non-blank string) and 'label' (a string), or 'tokens' and 'tags' "
                        f"(non-empty lists of strings) ({err['msg']})")
    if t == "missing":
        return ApiError(400, "missing_field", f"field {where!r} is required")
    if t == "extra_forbidden":
        return ApiError(400, "unknown_field", f"unknown field {where!r}")
    if t in ("missing_field",):
        return ApiError(400, t, err["msg"])
    if t == "reserved_name":
        return ApiError(400, "invalid_name", f"field {where!r}: {err['msg']}")
    top = names[0] if names else ""
    if t in ("missing", "extra_forbidden") or t.endswith("_type"):
        pass
    elif top in _BAD_VALUE:
        return ApiError(400, _BAD_VALUE[top], f"field {where!r}: {err['msg']}")
    elif field == "labels" and t == "too_long":
        return ApiError(400, "too_many_labels", f"more than {err['ctx']['max_length']} labels; this server serves "
                        "heads of at most that many")
    elif top in ("task", "adapter"):
        return ApiError(400, "invalid_spec", f"field {where!r}: {err['msg']}")
    if t in ("too_long", "string_too_long"):
        if t == "string_too_long":
            return ApiError(413, "input_too_long", f"{where} is longer than {err['ctx']['max_length']} characters")
        key = next((p for p in reversed(names) if p in _TOO_MANY), field)
        return ApiError(413, _TOO_MANY.get(key, "too_many_items"), f"{where} has more than {err['ctx']['max_length']} items")
    if t == "too_short" and field in _EMPTY:
        return ApiError(400, _EMPTY[field], f"{where} is empty")
    if t == "string_pattern_mismatch":
        if field in ("name", "domain", "parent", "model"):
            return ApiError(400, "invalid_name", f"invalid name in {where!r}: 1-63 characters a-z, 0-9, '_' or '-', "
                            "starting with a letter or digit")
        return ApiError(400, "empty_input", f"{where} is empty or blank")
    if t.endswith("_type") or t in ("int_from_float", "union_tag_invalid") or t.endswith("_parsing"):
        return ApiError(400, "invalid_type", f"field {where!r}: {err['msg']}")
    if t in ("literal_error", "enum"):
        if field in _UNKNOWN:
            return ApiError(400, _UNKNOWN[field], f"field {where!r}: {err['msg']}")
        if names and names[0] in ("task", "adapter"):
            return ApiError(400, "invalid_spec", f"field {where!r}: {err['msg']}")
    return ApiError(400, "invalid_value", f"field {where!r}: {err['msg']}")


def parse(model: type[BaseModel], body: dict) -> BaseModel:
    """Validates a JSON body with a model; raises the ApiError of its first problem."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise api_error(exc) from None
