"""Argument parsing shared by the subcommands (generate, bench, sweep): one-line errors, one flag
per method config field, the model and sampling options. The CLI modules import it; it imports
no engine code."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from .config import argparse_help, cli_flag, field_type
from .embedded import DEFAULT_TARGET, EMBEDDED
from .errors import DynaTreeError
from .kernels import LINEAR_KERNELS
from .methods import METHODS
from .weights import WEIGHT_FORMATS


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (DynaTreeError, exit 2 in main) and no usage dump."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)  # for error()
        return super().parse_known_args(args, namespace)

    def error(self, message):  # one line, no usage dump
        flag = re.fullmatch(r"argument (--[\w-]+)(?:/-\w)?: expected one argument", message)
        argv = getattr(self, "_argv", [])
        after = argv[argv.index(flag[1]) + 1: argv.index(flag[1]) + 2] if flag and flag[1] in argv else []
        if after and after[0].startswith("-") and after[0].split("=")[0] not in self._option_string_actions:
            # argparse took a value such as -1,8 for an option
            message += f" (a value that starts with '-' is written {flag[1]}=VALUE)"
        raise DynaTreeError(message)


def given_method_options(args: argparse.Namespace) -> dict:
    """The method options given on the command line (`method_options` leaves the others out of `args`)."""
    given = vars(args)
    return {name: given[name] for name in args.method_fields if name in given}  # the configs' field order


def method_options(parser: argparse.ArgumentParser, as_lists: bool = False,
                   baselines: bool = True) -> dict[str, list[str]]:
    """Add one flag per config field of every method; return field name -> methods using it.

    With `as_lists`, every flag takes a comma-separated list of values (for sweeps); without
    `baselines`, only dynatree's own methods' fields (not those of the hf-* and llama.cpp baselines).
    """
    fields: dict[str, list[tuple[str, dataclasses.Field]]] = {}
    for method in METHODS.values():
        if not baselines and method.policy_cls is None:
            continue
        for f in dataclasses.fields(method.config_cls):
            fields.setdefault(f.name, []).append((method.name, f))
    title = "method options, each a comma-separated list of values to sweep" if as_lists else "method options"
    group = parser.add_argument_group(f"{title} (defaults in brackets; every option: docs/methods.md)")
    for name, users in fields.items():
        f = users[0][1]
        flag = cli_flag(name)
        helps = argparse_help("; ".join(f"{m}: {fld.metadata['help']} [{fld.default}]" for m, fld in users))
        kind = field_type(f)
        if as_lists:
            group.add_argument(flag, dest=name, type=_list_of(kind), default=argparse.SUPPRESS, metavar="V1,V2", help=helps)
        elif kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=helps)
        else:
            group.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS, metavar=kind.__name__.upper(), help=helps)
    return {name: [m for m, _ in users] for name, users in fields.items()}


def _list_of(kind: type):
    def parse(text: str) -> list:
        values = []
        for item in text.split(","):
            item = item.strip()
            if kind is bool:
                if item.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise argparse.ArgumentTypeError(f"expected true/false values, got {item!r}")
                values.append(item.lower() in ("true", "1", "yes"))
            else:
                try:
                    values.append(kind(item))
                except ValueError:
                    raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value {item!r}") from None
        return values

    parse.__name__ = f"list of {kind.__name__}"
    return parse


def add_model_args(parser: argparse.ArgumentParser, draft_help: str, baselines: bool = True) -> None:
    """The model flags; without `baselines` (the server) the help leaves out what only hf-* use."""
    parser.add_argument(
        "--target", default=DEFAULT_TARGET,
        help=f"target model: hub id, local directory, .gguf file or an embedded alias ({', '.join(EMBEDDED)}) [{DEFAULT_TARGET}]",
    )
    parser.add_argument("--draft", default=None, help=draft_help)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto [cpu]")
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16, float16 or float64 [float32; bfloat16 where --weights is or "
                             "resolves to q4/int8, as auto does for the embedded default target]")
    parser.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS,
                        help="the target's weight format: dense (--dtype), q4 (a GGUF file's own 4-bit weights, "
                             "e.g. the embedded model's), int8 (quantized per channel at load), auto (q4 for a "
                             "GGUF target with 4-bit layers on the CPU unless another --dtype is given, else "
                             "dense); low-bit formats are CPU only and compute in bfloat16; draft LMs load dense in the "
                             "target's dtype, feature heads in int4 on a q4 target [auto]")
    parser.add_argument("--linear", default="auto", choices=LINEAR_KERNELS,
                        help="linear layers of our methods' models: oneDNN on weights packed once, or PyTorch's "
                             "stock kernels; auto = onednn on the CPU unless the second copy of the weights takes "
                             "over a quarter of the RAM" + (" (hf-* always run stock)" if baselines else "") + " [auto]")
    parser.add_argument("--compile", action="store_true",
                        help="run the target's and the draft's decode steps through torch.compile ("
                             + ("our methods, hf-ar with a static cache, and hf-assisted's target; " if baselines else "")
                             + "the first steps compile for minutes, later runs reuse the on-disk cache) [off]")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (lossless except wetap --verify beam and mtad: see README)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, help="softmax temperature, > 0 [1.0]")
    g.add_argument("--top-k", type=int, help="keep the k most probable tokens, k >= 1 [off]")
    g.add_argument("--top-p", type=float, help="nucleus: keep the most probable tokens up to mass top_p, in (0, 1] [off: 1.0]")
