"""A run's settings, with one home: ``RunConfig`` holds each setting's type, default, range and one line of help.

Its defaults are the paper's prune. ``spap prune``'s and ``spap plan``'s options are generated from its fields
(``add_options``), notebook 02's parameter cell reads its defaults (``PAPER``), ``spap_lib.run.PruneRun`` takes it,
and the plan's defaults are its own: changing a default is one line here (``tests/test_settings.py`` holds the
others to it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field


def setting(default, help: str, *, option: bool = True, **bounds):
    """One setting of a run: its default, one line of help, its range (``checks.Spec`` bounds; the type is the
    annotation's) and whether the command line offers it as an option (``option``)."""
    kind = {"default_factory": default} if callable(default) else {"default": default}
    return field(**kind, metadata={"help": help, "option": option, "spec": bounds})


@dataclass(frozen=True)
class RunConfig:
    """What a prune is asked for. The defaults are the paper's (Hu & Yuan, 2025: 128 × 2048 calibration tokens,
    SPAP removing a fifth of the decoder parameters, perplexity on the whole WikiText-2 test split in windows of
    2048)."""

    model: str = setting("smollm2-135m", "alias (spap plan --list), hub id, local checkpoint dir or .gguf file",
                         option=False)
    method: str = setting("spap", "a registered method or a composition, e.g. spap/select=act_norm")
    sparsity: float = setting(0.2, "share of decoder parameters to remove", ge=0, lt=1)
    nsamples: int = setting(128, "calibration windows (the paper's: 128)", ge=1)
    seqlen: int = setting(2048, "tokens per calibration window (the paper's: 2048)", ge=2)
    seed: int = setting(0, "seed of the window sampling and of the Adam mini-batches", ge=0)
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:1 ...")
    offload: str = setting("auto", "none | cpu | disk | auto (what the plan says fits)")
    save_dtype: str = setting("auto", "auto | float32 | bfloat16 | float16: the saved checkpoint's; auto: the "
                              "source's when it is half precision (a CPU prunes in float32), else the one pruned in")
    hparams: dict = setting(dict, "method hyperparameters over the method's defaults, as JSON: '{\"K\": 10}'")
    propagate: bool | None = setting(None, "calibrate layer i+1 on the pruned layer i (None: the method's own "
                                     "setting)", option=False)
    round_to: int | str | None = setting(None, "kept MLP widths a multiple of this: a number, or a format whose "
                                         "blocks must divide them (q8_0, q4_k_m, tensor_core ...); none: the "
                                         "method's own widths (the paper's); auto: 32 where the MLP is 512 or wider")
    eval_seqlen: int = setting(2048, "perplexity window (the paper's: 2048)", ge=2)
    eval_windows: int | None = setting(None, "cap on test windows (default: the whole split)", ge=1)
    evaluate: bool = setting(True, "the dense and pruned perplexity", option=False)
    heal_tokens: int = setting(0, "tokens of distillation from the dense model after the prune (0: none, the "
                               "paper's; docs/heal.md)", ge=0)
    heal_data: str | None = setting(None, "a UTF-8 text file to heal on (default: WikiText-2 train where the hub "
                                    "or its cache has it, else validation; never the test split)")
    heal: dict = setting(dict, "healing options over their defaults (HealConfig), as JSON: '{\"lr\": 1e-4}'")

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def check(self) -> "RunConfig":
        """Every field against its annotation and range (``checks.Spec``); the first refusal raises."""
        return check_fields(self)


def spec(name: str, optional: bool = False, of: type | None = None):
    """The ``checks.Spec`` of a ``RunConfig`` field (``of``: another settings class's): its type and range
    (``optional``: None allowed too, for a setting that is not part of every run)."""
    from spap_lib.checks import Spec

    of = of or RunConfig
    f = next(f for f in dataclasses.fields(of) if f.name == name)
    s = Spec.of(typing.get_type_hints(of)[name], **f.metadata["spec"])
    return dataclasses.replace(s, optional=True) if optional else s


def check_fields(settings, prefix: str = ""):
    """Every field of a settings dataclass against its annotation and range; the first refusal raises, naming the
    field (after ``prefix``)."""
    for f in dataclasses.fields(settings):
        spec(f.name, of=type(settings)).check(prefix + f.name, getattr(settings, f.name))
    return settings


@dataclass(frozen=True)
class HealConfig:
    """How a pruned model is distilled from the dense one (``spap_lib.heal``): the KL divergence of the logits over
    ``tokens`` tokens of ``data``, in windows of ``seqlen``, ``batch`` windows a step, AdamW with a linear warm-up
    and a cosine decay. ``train``: every weight, the MLPs only, or LoRA adapters (``peft``) merged back into the
    weights, so the checkpoint stays a stock one. Defaults: docs/heal.md."""

    tokens: int = setting(0, "tokens to distil on; 0: no healing", ge=0)
    data: str | None = setting(None, "a UTF-8 text file; default WikiText-2 train, else validation")
    seqlen: int = setting(512, "tokens per window", ge=2)
    batch: int = setting(1, "windows per optimizer step", ge=1)
    lr: float = setting(3e-4, "AdamW's peak learning rate (docs/heal.md: the rates measured)", gt=0, le=1)
    warmup: float = setting(0.05, "share of the steps spent warming the learning rate up", ge=0, lt=1)
    train: str = setting("all", "which weights learn: all, mlp, lora", choices=("all", "mlp", "lora"))
    lora_rank: int = setting(16, "rank of the LoRA adapters (train lora)", ge=1)
    temperature: float = setting(1.0, "softmax temperature of both models' logits in the KL term", gt=0)
    hidden_weight: float = setting(0.0, "weight of the last hidden state's normalised squared error", ge=0)
    precision: str = setting("auto", "auto (bf16 products where the device is fast in them), bf16, float32",
                             choices=("auto", "bf16", "float32"))
    seed: int = setting(0, "seed of the windows' order", ge=0)

    @classmethod
    def of(cls, run: "RunConfig") -> "HealConfig":
        """A run's healing: ``heal_tokens``, ``heal_data`` and the ``heal`` options; an unknown name is refused."""
        names = {f.name for f in dataclasses.fields(cls)} - {"tokens", "data"}
        unknown = sorted(set(run.heal) - names)
        if unknown:
            from spap_lib.errors import ParameterError

            raise ParameterError(f"heal options {unknown} unknown: it takes {', '.join(sorted(names))} "
                                 "(--heal-tokens and --heal-data are options of their own)")
        return cls(tokens=run.heal_tokens, data=run.heal_data, **run.heal).check()

    @property
    def steps(self) -> int:
        """Optimizer steps: the token budget in whole batches (at least one when there is a budget)."""
        return -(-self.tokens // (self.batch * self.seqlen)) if self.tokens else 0

    def check(self) -> "HealConfig":
        return check_fields(self, "heal ")


PAPER = RunConfig()  # the paper's settings: notebook 02's parameter cell and the plan read them here


def _json_object(text: str) -> dict:
    """A JSON object option, or an error that quotes the text and says what is wrong with it."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({err}); write e.g. '{{\"K\": 10, \"t\": 0.5}}' "
                                         "(double quotes inside single quotes)") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is JSON but not an object of name: value pairs, "
                                         "e.g. '{\"K\": 10}'")
    return value


_PARSE = {int: int, float: float, str: str, dict: _json_object}


def add_options(parser: argparse.ArgumentParser, names: tuple[str, ...], **defaults) -> None:
    """``--name`` options for these ``RunConfig`` fields, with their type, help and default (``defaults`` where a
    command's own differs: the plan's device is a planning row)."""
    hints = typing.get_type_hints(RunConfig)
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    for name in names:
        f = fields[name]
        kinds = [t for t in typing.get_args(hints[name]) or (hints[name],) if t is not type(None)]
        base = kinds[0] if len(kinds) == 1 else str  # a number or a name (round_to): the run reads the text
        default = defaults.get(name, getattr(PAPER, name))
        shown = "" if default in (None, {}) else f" (default: {default})"
        parser.add_argument(f"--{name.replace('_', '-')}", type=_PARSE[base], default=default,
                            help=f.metadata["help"] + shown)


def options(names: tuple[str, ...], parsed: argparse.Namespace) -> dict:
    """The values of these ``RunConfig`` options from parsed arguments."""
    return {name: getattr(parsed, name) for name in names}
