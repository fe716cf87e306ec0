"""--config FILE.toml: flag values from a TOML file, checked as the command line checks them.

flags.ArgumentParser reads the file before it parses the command line, and makes its values that
parse's defaults (config_namespace): a flag given on the command line wins over the file, the
file over the flag's default. Every lesson's parser is one, so every lesson (its own flags
included) takes --config.
"""

import argparse
import re


def config_namespace(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | None:
    """The defaults of a parse of argv: the values of the file its last --config names (--config
    FILE or --config=FILE, before any "--"), or None if it names none or the parser has no
    --config (a tool: argparse then refuses the flag, rather than checking a file it ignores)."""
    if "--config" not in parser._option_string_actions:
        return None
    path = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.removeprefix("--config=")
    return None if path is None else argparse.Namespace(**read_config(parser, path))


def read_config(parser: argparse.ArgumentParser, path: str) -> dict:
    """The flag values of a TOML file, {dest: value}, checked as the command line checks them.

    A key is a flag's name without its dashes, with - or _ between words (seq-length or
    seq_length), at the top level of the file; a value goes through the flag's own type and
    choices (a switch such as document-mask takes true or false). A file that cannot be read
    or parsed, an unknown key, a key given twice or a value of the wrong type: ValueError
    (parser.error) naming the file, the line and the key, before anything else happens.
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomllib is tomli, a package before 3.11
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            parser.error("--config needs Python 3.11 or newer (tomllib), or `pip install tomli`")
    try:
        with open(path, "rb") as f:
            text = f.read().decode()
        table = tomllib.loads(text)
    except OSError as e:
        parser.error(f"--config {path}: cannot read it ({e.strerror or e})")
    except UnicodeDecodeError:
        parser.error(f"--config {path}: not a TOML file (not UTF-8 text)")
    except tomllib.TOMLDecodeError as e:
        parser.error(f"--config {path}: not valid TOML: {e}")  # e names the line and column
    flags = {}  # every flag by its long name, but --help, --config and --no-X of --X/--no-X
    for action in parser._actions:
        for option in action.option_strings:
            negative = isinstance(action, argparse.BooleanOptionalAction) and "--no-" in option
            if option.startswith("--") and not negative and action.dest not in ("help", "config"):
                flags[option[2:]] = action
    values, keys = {}, {}
    for key, value in table.items():
        line = key_line(text, key)
        where = f"--config {path}" + (f", line {line}" if line else "") + f": {key}"
        action = flags.get(key.replace("_", "-"))
        if action is None:
            parser.error(
                f"{where}: no such flag (the keys are the flags' names, e.g. seq-length = 512)"
            )
        if action.dest in values:
            parser.error(f"{where}: given twice (also as {keys[action.dest]})")
        try:
            values[action.dest] = config_value(action, value)
        except ValueError as e:
            parser.error(f"{where}: {e}")
        keys[action.dest] = key
    return values


def config_value(action: argparse.Action, value):
    """A config file's value for `action`, as the command line would give it; ValueError if it
    does not fit the flag."""
    if isinstance(action, argparse.BooleanOptionalAction) or (
        isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool)
    ):
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        return action.const if value else action.default  # store_true / store_false
    if type(action) is not argparse._StoreAction or action.nargs is not None:
        raise ValueError("this flag cannot be set in a config file")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        kind = "a table" if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"expected a single value (a number or a string), got {kind} {value!r}")
    convert = action.type or str
    try:
        result = convert(value if isinstance(value, str) else str(value))
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None
    except (TypeError, ValueError):
        name = getattr(convert, "__name__", "")
        raise ValueError(f"invalid {name} value: {value!r}") from None
    if action.choices is not None and result not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise ValueError(f"invalid choice: {value!r} (choose from {choices})")
    return result


def key_line(text: str, key: str) -> int | None:
    """The line of a TOML file where a top-level key is set (bare or quoted, `key = ...`,
    `key.sub = ...` or `[key]`), for the messages; None if not found."""
    name = re.escape(key)
    pattern = re.compile(rf"""\s*(\[\s*)?("{name}"|'{name}'|{name})\s*[=.\]]""")
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.match(line):
            return number
    return None
