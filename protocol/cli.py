"""What the three scripts share on the command line: --version, --log-format, and one-line errors.

Convention: a mistake the user can fix (a bad flag, a missing file, an unreachable coordinator,
a port in use) ends the script with one line ``error: <what> <how to fix it>`` on stderr and
exit code 2, like argparse's own usage errors; a traceback (exit 1) means a bug.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import MISSING, Field, field, fields
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

from protocol.errors import Unavailable
from protocol.logs import LOG_FORMATS, configure_logging
from protocol.version import __version__

EXIT_USAGE = 2
T = TypeVar("T")


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"FedMoE {__version__}")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text lines for people, or one JSON object per line for machines (default: %(default)s)")


def setup_logging(args: argparse.Namespace, level: int = logging.INFO) -> None:
    configure_logging(args.log_format, level)


def report_error(args: argparse.Namespace, message: object) -> int:
    """Print the one error line (a JSON object with --log-format json); returns the exit code."""
    text = str(message).strip().replace("\n", " ")
    if isinstance(message, Unavailable) and "--coordinator-url" not in text and "--use-proxy" not in text:
        text += "; is the coordinator running there? check --coordinator-url"
    if getattr(args, "log_format", "text") == "json":
        print(json.dumps({"level": "ERROR", "logger": "cli", "message": text}), file=sys.stderr)
    else:
        print(f"error: {text}", file=sys.stderr)
    return EXIT_USAGE


def check_coordinator_url(url: str) -> str:
    """Refuse what requests would only fail on later with a cryptic InvalidSchema/InvalidURL.

    A comma list (relays and the root, protocol/probe.py) is checked URL by URL.
    """
    for one in (url.split(",") if "," in url else [url]):
        try:
            parts = urlsplit(one.strip())
            parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
        except ValueError as exc:  # e.g. "http://[::1" (Invalid IPv6 URL), "http://host:99999"
            raise ValueError(f"--coordinator-url {one.strip()!r} is not a valid URL ({exc}); "
                             "use e.g. http://127.0.0.1:5000") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--coordinator-url {one.strip()!r} is not an http(s) address; "
                             "use e.g. http://127.0.0.1:5000 (or several, comma-separated)")
    return url


# --- Flags from config dataclasses ------------------------------------------------------------------------
# One source for each setting: a dataclass field carries its default and its help (as PEFT's LoraConfig does),
# and argparse is built from the fields, so a flag, its default and its help (and docs/cli.md, generated from
# --help) cannot drift apart. Adding a flag is one field:
#
#     buffer_size: int = option(3, "K updates per fedbuff step")
#
# A field without help (a plain default) is no flag. See docs/cli.md for the pattern and the metadata keys.

def option(default: Any = MISSING, help: str = "", *, flag: str | None = None, default_factory: Any = MISSING,
           parse: Callable[[str, str], Any] | None = None, **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also a command-line flag.

    help      the flag's help; " (default: ...)" is added unless it says "(default" itself or the default is None
    flag      the flag's name when it is not --<field-name>; a bool that defaults to True becomes a store_false
              flag, so name it for what it turns off (``flag="--no-auth"``)
    parse     ``parse(text, flag)`` turns the flag's string into the field's value (JSON, lists); it is applied
              only when the flag is given and raises ValueError naming the flag
    others    passed to ``add_argument`` (choices, metavar, type for a field whose default is None, ...);
              ``group="title"`` puts the flag in an argument group
    """
    if not help:
        raise TypeError("option() needs help text: it is the flag's --help line")
    meta = {"help": help, "flag": flag, "parse": parse, "argparse": argparse_kwargs}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_fields(cls: type) -> list[Field]:
    """The fields of `cls` that are flags, in declaration order."""
    return [f for f in fields(cls) if f.metadata.get("help")]


def flag_name(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _dest(f: Field) -> str:
    if _default(f) is True:  # --no-auth sets args.auth = False
        return f.name
    return flag_name(f).lstrip("-").replace("-", "_")


def _default(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of `cls` that has help (see `option`); groups are made on first use."""
    groups: dict[str, Any] = {}
    for f in flag_fields(cls):
        kwargs = dict(f.metadata["argparse"])
        title = kwargs.pop("group", None)
        target = parser if title is None else groups.setdefault(title, _group(parser, title))
        default = _default(f)
        help_text = f.metadata["help"]
        if default is MISSING:
            kwargs.setdefault("type", str)
            kwargs["required"] = True
        elif isinstance(default, bool):
            kwargs.setdefault("action", "store_false" if default else "store_true")
        else:
            if f.metadata["parse"] is None:
                # a list default (action="append") holds strings: type=list would split "w9" into ["w", "9"]
                scalar = default is not None and not isinstance(default, (list, tuple))
                kwargs.setdefault("type", type(default) if scalar else str)
                kwargs["default"] = default
            else:
                kwargs["default"] = None  # the dataclass default stands unless the flag is given
            if default is not None and "(default" not in help_text:
                help_text += " (default: %(default)s)" if f.metadata["parse"] is None else f" (default: {default})"
        target.add_argument(flag_name(f), dest=_dest(f), help=help_text, **kwargs)


def _group(parser: argparse.ArgumentParser, title: str) -> Any:
    for group in parser._action_groups:  # one group per title across several dataclasses
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """{field name: value} for the flags of `cls` in parsed `args`; ValueError (naming the flag) on a bad value."""
    values = {}
    for f in flag_fields(cls):
        value = getattr(args, _dest(f))
        parse = f.metadata["parse"]
        if parse is not None:
            if value is None:
                continue
            value = parse(value, flag_name(f))
        values[f.name] = value
    return values


def from_flags(cls: type[T], args: argparse.Namespace, **others: Any) -> T:
    """`cls` built from its flags in `args`, plus fields that are no flags."""
    return cls(**flag_values(cls, args), **others)


def json_object(text: str, flag: str) -> dict[str, Any]:
    """`parse` for a flag holding a JSON object, e.g. ``--gateway-config '{"density": 0.2}'``."""
    from protocol.schemas import parse_json_flag  # numpy: imported only when such a flag is given

    return parse_json_flag(text, flag)


def comma_list(text: str, flag: str) -> tuple[str, ...]:
    """`parse` for a comma-separated flag, e.g. ``--target-modules q_proj,v_proj``."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
