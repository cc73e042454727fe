"""Documentation tasks: docstrings in three styles, README sections and changelog entries."""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from .pyfunc import PyFunction


@dataclass(frozen=True)
class DocTask:
    id: str
    prompt: str
    answer: str


def _pick(key: str, n: int) -> int:
    """A stable choice in range(n) from a string (never Python's salted hash())."""
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % n


def _google(f: PyFunction) -> str:
    args = "".join(f"    {p.name}: {p.doc}\n" for p in f.params)
    return f'"""{f.summary}\n\nArgs:\n{args}\nReturns:\n    {f.returns_doc}\n"""\n'


def _numpy(f: PyFunction) -> str:
    params = "".join(f"{p.name} : {p.type}\n    {p.doc}\n" for p in f.params)
    return (f'"""{f.summary}\n\nParameters\n----------\n{params}\nReturns\n-------\n'
            f'{f.returns}\n    {f.returns_doc}\n"""\n')


def _sphinx(f: PyFunction) -> str:
    params = "".join(f":param {p.name}: {p.doc}\n:type {p.name}: {p.type}\n" for p in f.params)
    return f'"""{f.summary}\n\n{params}:returns: {f.returns_doc}\n:rtype: {f.returns}\n"""\n'


DOCSTRING_STYLES = [
    ("Google", _google, "Write a Google-style docstring for this Python function. Reply with the docstring only."),
    ("NumPy", _numpy, "Document the following function with a NumPy-style docstring (Parameters and Returns sections)."),
    ("Sphinx", _sphinx, "Write a reStructuredText docstring using Sphinx field lists (:param:, :type:, :returns:, :rtype:) "
                        "for this function."),
]


def docstring_tasks(functions: list[PyFunction], share: int = 7) -> list[DocTask]:
    """Docstrings for about share/10 of the functions, each in one stable style."""
    tasks = []
    for f in functions:
        if _pick("docs:" + f.name, 10) >= share:
            continue
        style, render, instruction = DOCSTRING_STYLES[_pick("style:" + f.name, len(DOCSTRING_STYLES))]
        code = f.code
        tasks.append(DocTask(f"docstring/{style.lower()}/{f.name}", f"{instruction}\n\n```python\n{code}```",
                             render(f)))
    return tasks


# (name, what it does, example positional argument, options: (flag, metavar, default, description))
TOOLS = [
    ("csvtrim", "removes empty columns and blank rows from CSV files", "data.csv",
     [("--output", "PATH", "stdout", "Where to write the cleaned file."), ("--delimiter", "CHAR", ",", "Field separator."),
      ("--keep-blank-rows", "", "off", "Keep rows that contain only empty cells."),
      ("--encoding", "NAME", "utf-8", "Text encoding of the input."), ("--quiet", "", "off", "Do not print a summary.")]),
    ("logsift", "filters and summarises application log files", "app.log",
     [("--level", "LEVEL", "INFO", "Lowest level to show (DEBUG, INFO, WARNING, ERROR)."),
      ("--since", "TIME", "none", "Only show entries after this ISO timestamp."),
      ("--grep", "PATTERN", "none", "Regular expression the message must match."),
      ("--summary", "", "off", "Print counts per level instead of the lines."), ("--follow", "", "off", "Keep reading as the file grows.")]),
    ("imgshrink", "resizes and recompresses images for the web", "photos/",
     [("--max-width", "PIXELS", "1600", "Largest width of the output images."), ("--quality", "N", "82", "JPEG quality from 1 to 100."),
      ("--format", "FMT", "jpeg", "Output format: jpeg, png or webp."), ("--out-dir", "DIR", "./out", "Directory for the results."),
      ("--strip-metadata", "", "off", "Remove EXIF data.")]),
    ("dupfind", "finds duplicate files by content hash", "~/Documents",
     [("--min-size", "BYTES", "1", "Ignore files smaller than this."), ("--hash", "ALGO", "sha256", "Hash algorithm to use."),
      ("--delete", "", "off", "Delete all but the first copy (asks first)."), ("--json", "", "off", "Print the groups as JSON."),
      ("--exclude", "GLOB", "none", "Skip paths matching this pattern; may be repeated.")]),
    ("mdtoc", "inserts a table of contents into Markdown files", "README.md",
     [("--depth", "N", "3", "Deepest heading level to include."), ("--in-place", "", "off", "Rewrite the file instead of printing."),
      ("--marker", "TEXT", "<!-- toc -->", "Where the table is inserted."), ("--numbered", "", "off", "Number the entries."),
      ("--check", "", "off", "Exit with status 1 if the table is out of date.")]),
    ("portwatch", "reports which local TCP ports are listening and by which process", "",
     [("--range", "LO-HI", "1-65535", "Ports to inspect."), ("--interval", "SECONDS", "0", "Repeat every N seconds (0 = once)."),
      ("--json", "", "off", "Machine-readable output."), ("--only-new", "", "off", "Report ports that opened since the last run."),
      ("--no-names", "", "off", "Skip looking up process names.")]),
    ("envcheck", "verifies that required environment variables are set", ".env.example",
     [("--strict", "", "off", "Also fail on variables that are set but empty."), ("--export", "", "off", "Print export lines for missing values."),
      ("--prefix", "TEXT", "none", "Only check variables starting with this prefix."),
      ("--format", "FMT", "text", "Report format: text or json."), ("--allow", "NAME", "none", "Variable that may be missing; may be repeated.")]),
    ("tsvstats", "prints per-column statistics for tab-separated data", "measurements.tsv",
     [("--columns", "LIST", "all", "Comma-separated column names."), ("--percentiles", "LIST", "50,90,99", "Percentiles to report."),
      ("--no-header", "", "off", "The first row is data."), ("--precision", "N", "3", "Decimal places in the output."),
      ("--missing", "TEXT", "NA", "Value that marks a missing cell.")]),
    ("gitstale", "lists git branches with no commits in a while", ".",
     [("--days", "N", "90", "Age after which a branch is stale."), ("--remote", "NAME", "origin", "Remote to inspect."),
      ("--merged-only", "", "off", "Only list branches already merged."), ("--delete", "", "off", "Delete the listed local branches."),
      ("--author", "EMAIL", "none", "Only branches whose last commit is by this author.")]),
    ("sqlfmt-lite", "formats SQL files with upper-case keywords and one clause per line", "queries/",
     [("--indent", "N", "2", "Spaces per indentation level."), ("--check", "", "off", "Report files that would change."),
      ("--lowercase", "", "off", "Use lower-case keywords instead."), ("--max-line", "N", "100", "Wrap lines longer than this."),
      ("--dialect", "NAME", "sqlite", "SQL dialect: sqlite, postgres or mysql.")]),
    ("backup-rotate", "keeps a fixed number of daily, weekly and monthly backups", "/var/backups",
     [("--daily", "N", "7", "Daily backups to keep."), ("--weekly", "N", "4", "Weekly backups to keep."),
      ("--monthly", "N", "12", "Monthly backups to keep."), ("--dry-run", "", "off", "Show what would be deleted."),
      ("--pattern", "GLOB", "*.tar.gz", "Which files count as backups.")]),
    ("httpping", "measures the response time of an HTTP endpoint", "https://example.org/health",
     [("--count", "N", "10", "Number of requests."), ("--timeout", "SECONDS", "5", "Per-request timeout."),
      ("--method", "VERB", "GET", "HTTP method to use."), ("--header", "K:V", "none", "Extra request header; may be repeated."),
      ("--fail-above", "MS", "none", "Exit with status 1 if the median exceeds this.")]),
]


def _option_label(flag: str, metavar: str) -> str:
    return f"`{flag} {metavar}`" if metavar else f"`{flag}`"


def _example_option(options: list[tuple[str, str, str, str]]) -> str:
    flag, metavar, default, _ = options[0]
    if not metavar:
        return flag
    return f"{flag} {default if default not in ('none', 'off', 'stdout', 'all') else metavar}"


def _readme(name: str, purpose: str, example: str, options: list[tuple[str, str, str, str]]) -> str:
    rows = "".join(f"| {_option_label(f, m)} | {d} | {desc} |\n" for f, m, d, desc in options)
    usage = f"{name} [options] {example}".rstrip()
    sample = f"{name} {_example_option(options)} {example}".rstrip()
    return (f"# {name}\n\n`{name}` {purpose}.\n\n## Installation\n\n```bash\npip install {name}\n```\n\n"
            f"## Usage\n\n```bash\n{usage}\n```\n\n## Options\n\n| Option | Default | Description |\n|---|---|---|\n{rows}\n"
            f"## Example\n\n```bash\n{sample}\n```\n")


def readme_tasks(per_tool: int = 5) -> list[DocTask]:
    tasks = []
    for name, purpose, example, options in TOOLS:
        rng = random.Random(f"readme:{name}")
        subsets = {tuple(sorted(rng.sample(range(len(options)), rng.randint(2, len(options))))) for _ in range(40)}
        for k, subset in enumerate(sorted(subsets)[:per_tool]):
            chosen = [options[i] for i in subset]
            listed = "\n".join(f"- {f}{' ' + m if m else ''} (default: {d}): {desc}" for f, m, d, desc in chosen)
            arg = f" It takes `{example}` as an example argument." if example else ""
            prompt = (f"Write a short README in Markdown for `{name}`, a command-line tool that {purpose}.{arg} "
                      f"Include installation, usage, an options table and one example.\n\nOptions:\n{listed}")
            tasks.append(DocTask(f"readme/{name}/{k}", prompt, _readme(name, purpose, example, chosen)))
    return tasks


# Keep a Changelog sections in their canonical order: (verb in the notes, past tense in the entry, items).
CHANGES = {
    "Added": ("add", "Added", ["a --quiet flag that hides progress output", "support for gzip-compressed input",
                      "a JSON output format", "Windows path handling", "a progress bar for long runs",
                      "retry with exponential backoff for network calls", "a --dry-run option",
                      "type hints to the public API", "an environment variable for the config path",
                      "shell completion for bash and zsh"]),
    "Changed": ("change", "Changed", ["the default timeout from 10 to 30 seconds", "log messages to include the request id",
                           "the cache directory to follow the XDG specification", "error messages to name the bad option",
                           "the minimum batch size to 16", "sorting to be stable across platforms"]),
    "Deprecated": ("deprecate", "Deprecated", ["the --legacy-format flag", "the `load_config_file` function",
                                 "reading settings from setup.cfg", "the v1 HTTP endpoints"]),
    "Removed": ("remove", "Removed", ["support for Python 3.8", "the unused `utils.compat` module", "the --no-color alias",
                           "the deprecated `Client.fetch_all` method"]),
    "Fixed": ("fix", "Fixed", ["a crash when the header row is empty", "a memory leak in the file watcher",
                      "wrong totals when a row contains a trailing comma", "timezone handling for dates before 1970",
                      "a race condition when two processes write the cache", "Unicode file names on macOS",
                      "the exit status when no input files match"]),
    "Security": ("patch", "Patched", ["a path traversal in archive extraction", "unsafe YAML loading in the config reader",
                           "a leak of the session token into the debug log"]),
}
PACKAGES = ["fastcsv", "pyroute", "tinyqueue", "confload", "metricsd", "shelfdb", "wirelog", "taskpool"]


def changelog_tasks(count: int = 70) -> list[DocTask]:
    rng = random.Random("changelog")
    tasks = []
    for k in range(count):
        package = PACKAGES[k % len(PACKAGES)]
        version = f"{rng.randint(0, 4)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}"
        date = f"{rng.randint(2021, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        notes = []
        for section in rng.sample(sorted(CHANGES), rng.randint(2, 4)):
            verb, past, items = CHANGES[section]
            notes += [(section, verb, f"{past} {item}") for item in rng.sample(items, rng.randint(1, min(3, len(items))))]
        rng.shuffle(notes)
        listed = "\n".join(f"- {verb} {item.split(' ', 1)[1]}" for _, verb, item in notes)
        prompt = (f"Turn these release notes into a Keep a Changelog entry for {package} {version}, released {date}. "
                  f"Group the items under the standard headings.\n\nNotes:\n{listed}")
        body = ""
        for section in CHANGES:
            items = [item for s, _, item in notes if s == section]
            if items:
                body += f"\n### {section}\n\n" + "".join(f"- {item}.\n" for item in items)
        tasks.append(DocTask(f"changelog/{package}/{version}/{k}", prompt, f"## [{version}] - {date}\n{body}"))
    return tasks
