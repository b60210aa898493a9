"""Read a YAML file: with PyYAML when it is installed, else with a reader for the subset that
`accelerate config` writes (nested block mappings, `- item` lists, flow `[a, b]` / `{}`, quoted and
plain scalars, comments), so the base package reads Accelerate configs without extra dependencies.
Anything outside that subset is an error naming the line and suggesting `pip install pyyaml`."""

from __future__ import annotations

import re

_INT = re.compile(r"[-+]?(0|[1-9][0-9_]*)")
_FLOAT = re.compile(r"[-+]?([0-9][0-9_]*)?\.?[0-9]+([eE][-+]?[0-9]+)?")


def load_yaml(path: str):
    """The document in `path` (PyYAML's safe loader when available, else the subset reader)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        import yaml
    except ImportError:
        return parse_subset(text, path)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML: {err}") from None


def parse_subset(text: str, source: str = "<yaml>"):
    """Parse the subset of YAML that `accelerate config` writes."""
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        body = _strip_comment(raw).rstrip()
        if body.strip() and body.strip() != "---":
            lines.append((number, len(body) - len(body.lstrip(" ")), body.strip()))
    if not lines:
        return None
    value, end = _block(lines, 0, lines[0][1], source)
    if end != len(lines):
        number = lines[end][0]
        raise _error(source, number, "unexpected indentation")
    return value


def _block(lines, start: int, indent: int, source: str):
    """A mapping or list at `indent` from lines[start]; returns (value, index after it)."""
    if lines[start][2].startswith("- ") or lines[start][2] == "-":
        return _list(lines, start, indent, source)
    out: dict = {}
    i = start
    while i < len(lines) and lines[i][1] == indent:
        number, _, body = lines[i]
        key, sep, rest = body.partition(":")
        if not sep or (rest and not rest.startswith(" ")):
            raise _error(source, number, f"expected 'key: value', got {body!r}")
        key = _scalar(key.strip(), source, number)
        rest = rest.strip()
        i += 1
        if rest:
            out[key] = _scalar(rest, source, number)
        elif i < len(lines) and lines[i][1] > indent:
            out[key], i = _block(lines, i, lines[i][1], source)
        elif i < len(lines) and lines[i][1] == indent and lines[i][2].startswith("-"):
            out[key], i = _list(lines, i, indent, source)  # a list may sit at the key's indent
        else:
            out[key] = None
    if i < len(lines) and lines[i][1] > indent:
        raise _error(source, lines[i][0], "unexpected indentation")
    return out, i


def _list(lines, start: int, indent: int, source: str):
    out = []
    i = start
    while i < len(lines) and lines[i][1] == indent and (lines[i][2] == "-" or lines[i][2].startswith("- ")):
        number, _, body = lines[i]
        item = body[1:].strip()
        if ":" in item and not item.startswith(("'", '"', "[", "{")):
            raise _error(source, number, "mappings inside lists are outside the subset read "
                                         "without PyYAML")
        out.append(_scalar(item, source, number) if item else None)
        i += 1
    return out, i


def _scalar(text: str, source: str, number: int):
    if text[:1] in ("'", '"'):
        quote = text[0]
        if len(text) < 2 or text[-1] != quote:
            raise _error(source, number, f"unterminated quoted string {text!r}")
        inner = text[1:-1]
        return inner.replace("''", "'") if quote == "'" else bytes(inner, "utf-8").decode("unicode_escape")
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [_scalar(part.strip(), source, number) for part in inner.split(",")] if inner else []
    if text == "{}":
        return {}
    if text.startswith(("{", "[", "&", "*", "!", "|", ">")):
        raise _error(source, number, f"{text!r} is outside the subset read without PyYAML")
    lowered = text.lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("null", "~"):
        return None
    if _INT.fullmatch(text):
        return int(text.replace("_", ""))
    if _FLOAT.fullmatch(text):
        return float(text.replace("_", ""))
    return text


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in ("'", '"'):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def _error(source: str, number: int, what: str) -> ValueError:
    return ValueError(f"{source}, line {number}: {what}; install PyYAML (pip install pyyaml) to "
                      "read any YAML")
