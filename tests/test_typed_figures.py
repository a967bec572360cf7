"""No measured figure typed by hand: not in the docs, the README, nor a docstring or comment under
src/. A measurement lives in docs/figures.md, rendered from a kept artifact (``make figures``), and
prose links it (``figures.md#ANCHOR``); what the scan finds anywhere else must be in ``ALLOWED``,
each entry a value that is not a measurement, with the reason."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from dspark.bench.figures import HEADLINE_END, HEADLINE_START

ROOT = Path(__file__).resolve().parents[1]

# A number with a unit of time, size, bandwidth, throughput, a speedup or a share ("12.5 ms",
# "3 seconds", "1.4 GB/s", "1.88x", "15%", "15 per cent"), and in a Markdown table whose header names
# such a unit, any decimal in its rows.
_MEASURED = re.compile(r"(?<![\w.])\d(?:[\d,]*\d)?(?:\.\d+)?(?:\s?(?:ms|s|us|µs|ns|KB|KiB|MB|MiB|GB|GiB|TB|TiB"
                       r"|GB/s|MB/s|Gb/s|seconds?|milliseconds?|microseconds?|minutes?|hours?|samples/s"
                       r"|tokens/s|TFLOP/s)\b|x\b|×(?!\d)|\s?%|\s(?:per ?cent|percent)\b)")
_UNIT_HEADER = re.compile(r"\b(?:ms|s|seconds|us|KB|MB|MiB|GB|GiB|GB/s|speedup)\b")
_DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+")

# Figures that are not measurements, each with why: (file, text, reason). The text explains the
# figures inside it on a line, no other figure of that line; a text "## a section heading" explains
# the figures in the rows of that section's tables (not its prose). An entry that matches nothing
# fails the test.
ALLOWED: tuple[tuple[str, str, str], ...] = (
    # docs: how the lab writes things, and the rules' thresholds
    ("docs/bench.md", "`1.88x (1.80-1.95)`", "how a speedup cell is formatted"),
    ("docs/bench.md", "2.0x a 1/2 share", "the wording of the engine's audit line"),
    ("docs/bench.md", "(25 MiB)", "DSpark's default bucket size, a config value"),
    ("docs/bench.md", "more than 30% (twice", "suspect_baseline's thresholds, constants of the rule"),
    ("docs/bench.md", "(by more than 3%: perfect", "suspect_baseline's margin, a constant of the rule"),
    ("docs/bench.md", "by more than 25%, or the step by more than 50%", "off_plan's tolerances, constants"),
    ("docs/bench.md", "more than 10% of a rank's core", "busy_machine's allowance, a constant"),
    ("docs/bench.md", "1.5x a 1/N share", "an anomaly rule's threshold"),
    ("docs/bench.md", "+ 1 ms", "an anomaly rule's threshold"),
    ("docs/bench.md", "else 15%, the range", "the noise rule's default, a constant"),
    ("docs/bench.md", "the 15% default", "the noise rule's default, a constant"),
    ("docs/checkpoints.md", "## Bounds on what is read", "the bounds on files read, constants of "
     "checkpoint/plain_files.py, and the sizes DSpark writes by construction"),
    ("docs/checkpoints.md", "`manifest.json` of 200 MB", "a crafted file's size: a test's input"),
    ("docs/cli.md", "300 s by default", "the collective timeout's default, a config value"),
    ("docs/launch.md", "**300 s by", "the collective timeout's default, a config value"),
    ("docs/launch.md", "timed out after 20 s", "an example message: the timeout its job set"),
    ("docs/launch.md", "(a 3 s timeout", "the timeout a test sets"),
    ("docs/engine-internals.md", "from 1 MiB of parameters", "the zero3 unit rule's threshold"),
    ("docs/engine-internals.md", "at most 16 MiB of parameters", "the prefetch rule's threshold"),
    ("docs/engine-internals.md", "32 MiB stay in the heap", "glibc's mmap threshold, a config value"),
    ("docs/engine-internals.md", "tensors above 32 MiB", "glibc's mmap threshold, a config value"),
    ("docs/engine-internals.md", "(the larger of 16 MiB and 2%", "the heap guard's floor and share, GROWTH_FLOOR_BYTES "
                                                                 "and GROWTH_SHARE"),
    ("docs/plan.md", "the larger of 16 MiB and 2%", "the heap guard's floor and share, GROWTH_FLOOR_BYTES and "
                                                    "GROWTH_SHARE"),
    ("docs/engine-internals.md", "(1 MiB and up mapped", "the lean choice's threshold, a config value"),
    ("docs/engine-internals.md", "region (16 MiB per rank", "the shared-memory region's default size"),
    ("docs/engine-internals.md", "(2 x 16 MiB on 2", "the shared-memory region's default size"),
    ("docs/observe.md", "2.0x a 1/2 share", "the audit's words for a batch replicated on 2 ranks: "
                                            "exactly twice a half, by construction"),
    ("docs/observe.md", "3.0x a 1/2 share", "the audit's words for a zero3 parameter left whole on "
                                            "2 ranks: the whole plus its own half, by construction"),
    ("docs/plan.md", "--memory-budget 24GB", "a command-line argument"),
    ("docs/plan.md", "less 10%", "the default memory budget's margin and auto's tie rule, constants"),
    ("docs/plan.md", "at most 16 MiB, the engine's", "the prefetch rule's threshold"),
    ("docs/plan.md", "### Interconnect profiles", "datasheet rates and the profiles' constants"),
    ("docs/plan.md", "### Device profiles", "datasheet rates, the constants of dspark.planner.DEVICES"),
    ("docs/plan.md", "typically 70-90% of that", "what NCCL reaches of a link's nominal rate, a rule "
                                                 "of thumb NVIDIA publishes, not DSpark's measurement"),
    ("docs/plan.md", "200 Gb/s RoCE", "a NIC's datasheet rate"),
    ("docs/plan.md", "by more than 25% (plus 2 MB) or the step by more than 50%", "the off_plan rule's "
                                                                                  "tolerances"),
    ("docs/plan.md", "(peak +25%, step +50%)", "the off_plan rule's tolerances"),
    ("docs/plan.md", "1 device at 245 ms", "the synthetic results of tests/bench/factory.py"),
    ("docs/plan.md", "replicated at 280 ms", "the synthetic results of tests/bench/factory.py"),
    ("docs/plan.md", "peak 2400.0 MB per rank against the plan's 1408.9 MB (1.70x); activations 2.0x",
     "off_plan's line for the synthetic results"),
    ("docs/plan.md", "step 280 ms against the plan's 133 ms (2.10x)", "off_plan's line for the synthetic results"),
    ("docs/plan.md", "an 80 GB H100", "a GPU's memory, from its datasheet"),
    ("docs/pretrained.md", 'max_shard_size="5GB"', "an argument's value"),
    ("docs/pretrained.md", "default `5GB`", "an argument's default"),
    ("docs/pretrained.md", "1354 MiB in fp32", "the model's size: parameters x 4 bytes"),
    ("docs/pretrained.md", "474.70 MiB (497,759,232 bytes)", "the model's size: parameters x 4 bytes"),
    # src: examples of what a function returns for its argument, arguments, and config values
    ("src/dspark/bench/present/formatting.py", '(280.0)   # "280 ms"',
     "a formatter's example: the text its argument gives"),
    ("src/dspark/bench/present/formatting.py", '(2.456)   # "2.46 ms"',
     "a formatter's example: the text its argument gives"),
    ("src/dspark/bench/present/formatting.py", '(25_000_000)  # "25.0 MB"',
     "a formatter's example: the text its argument gives"),
    ("src/dspark/bench/present/formatting.py", '(result)   # "1.88x (1.80-1.95)"', "a formatter's example: the text "
                                                                         "its argument gives"),
    ("src/dspark/bench/analyse/anomalies.py", "2.0x a 1/2 share", "the audit's words for a replicated batch"),
    ("src/dspark/engine/audit.py", "2.0x a 1/2 share", "the audit's words for a replicated batch"),
    ("src/dspark/engine/engine.py", "2.0x a 1/2 share", "the audit's words for a replicated batch"),
    ("src/dspark/checkpoint/hf_files.py", '"5GB"', "a size argument, HuggingFace's way"),
    ("src/dspark/checkpoint/hf_files.py", '"500MiB"', "a size argument"),
    ("src/dspark/checkpoint/hf_files.py", '"2MiB"', "a size argument"),
    ("src/dspark/cli/plan_cmd.py", '"24GB"', "--memory-budget's examples"),
    ("src/dspark/cli/plan_cmd.py", '"1.5GiB"', "--memory-budget's examples"),
    ("src/dspark/cli/plan_cmd.py", '"512MiB"', "--memory-budget's examples"),
    ("src/dspark/engine/engine.py", '"5GB"', "max_shard_size's examples"),
    ("src/dspark/engine/engine.py", '"500MB"', "max_shard_size's examples"),
    ("src/dspark/engine/pretrained.py", 'max_shard_size="5GB"', "an argument's value"),
    ("src/dspark/host/gpus.py", "Link 0: 26.562 GB/s", "nvidia-smi's output format, parsed"),
    ("src/dspark/comm/shm_setup.py", "/dev/shm is 64 MB", "Docker's default size, a config value"),
    ("src/dspark/cpu_malloc.py", "32 MiB", "glibc's highest mmap threshold, a config value"),
    ("src/dspark/cpu_malloc.py", "2 GiB", "the heap choice's threshold, a config value"),
    ("src/dspark/cpu_malloc.py", "1 MiB", "the lean choice's threshold, a config value"),
    ("src/dspark/cpu_malloc.py", "each 4 KiB page", "the kernel's page size"),
    ("docs/engine-internals.md", "each 4 KiB page", "the kernel's page size"),
    ("docs/engine-internals.md", "2 MiB pages", "the kernel's huge page size on x86-64"),
    ("src/dspark/cpu_malloc.py", "glibc's starting 128 KiB", "glibc's default trim threshold, a config value"),
    ("src/dspark/planner/link_probe.py", "bandwidth of 1 TB/s", "the probe's stand-in for a time that "
                                                               "does not grow with the bytes, a constant"),
)


def _doc_texts() -> dict[str, str]:
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))
             if p.name != "figures.md"}
    texts["CONTRIBUTING.md"] = (ROOT / "CONTRIBUTING.md").read_text()
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index(HEADLINE_START), readme.index(HEADLINE_END)
    texts["README.md"] = readme[:start] + "\n" * readme[start:end].count("\n") + readme[end:]  # generated
    return texts


def source_prose(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every docstring (any string statement) and comment of a module."""
    lines: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            lines += [(node.value.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    lines += [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(text).readline)
              if token.type == tokenize.COMMENT]
    return lines


def typed_figures(text: str) -> list[tuple[int, str, str, int]]:
    """``(line number, figure, the line's section headings, where on the line it starts)`` of every
    measured-looking figure."""
    found: list[tuple[int, str, str, int]] = []
    headings: dict[int, str] = {}
    unit_table = in_fence = False
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        in_fence ^= line.lstrip().startswith("```")
        if line.startswith("#") and not in_fence:
            level = len(line) - len(line.lstrip("#"))
            headings = {k: v for k, v in headings.items() if k < level} | {level: line}
        if line.startswith("|") and not line.startswith("|---"):
            if number < 2 or not lines[number - 2].startswith("|"):   # a header row
                unit_table = bool(_UNIT_HEADER.search(line))
            elif unit_table:
                found += [(number, m.group(), " / ".join(headings.values()), m.start())
                          for m in _DECIMAL.finditer(line)]
                continue
        found += [(number, m.group(), " / ".join(headings.values()), m.start())
                  for m in _MEASURED.finditer(line)]
    return found


def _allowed(name: str, line: str, figure: str, start: int, section: str) -> tuple[str, str, str] | None:
    """The entry that explains ``figure`` at ``line[start:]``: one whose text holds it there, or one
    naming its section when the line is a table row."""
    for entry in ALLOWED:
        if entry[0] != name:
            continue
        if entry[1].startswith("#"):
            if line.startswith("|") and any(h.startswith(entry[1]) for h in section.split(" / ")):
                return entry
        elif any(m.start() <= start and start + len(figure) <= m.end()
                 for m in re.finditer(re.escape(entry[1]), line)):
            return entry
    return None


def typed_outside_figures_md() -> tuple[list[str], set[tuple[str, str, str]]]:
    """Every figure found outside figures.md that no ALLOWED entry explains, and the entries used."""
    typed, used = [], set()
    for name, text in _doc_texts().items():
        lines = text.splitlines()
        for number, figure, section, start in typed_figures(text):
            entry = _allowed(name, lines[number - 1], figure, start, section)
            if entry is None:
                typed.append(f"{name}:{number}: {figure!r} in {lines[number - 1].strip()[:100]!r}")
            else:
                used.add(entry)
    for path in sorted((ROOT / "src").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        for number, line in source_prose(path.read_text()):
            for match in _MEASURED.finditer(line):
                entry = _allowed(name, line, match.group(), match.start(), "")
                if entry is None:
                    typed.append(f"{name}:{number}: {match.group()!r} in {line.strip()[:100]!r}")
                else:
                    used.add(entry)
    return typed, used


def test_no_measured_figure_is_typed_outside_figures_md():
    typed, used = typed_outside_figures_md()
    assert typed == [], ("measured figures typed by hand (keep them in an artifact and link to "
                         "figures.md#ANCHOR, or add an entry to ALLOWED if it is no measurement):\n"
                         + "\n".join(typed))
    assert [e[:2] for e in ALLOWED if e not in used] == [], "ALLOWED entries that match nothing"


def test_a_typed_figure_is_caught():
    text = ("# T\n\nA load took 4.83 s and 1.2 GB, 1.96x faster, 15% less.\n\n| run | step |\n|---|---|\n"
            "| 1 | 354.3 ms |\n")
    assert [f for _, f, _, _ in typed_figures(text)] == ["4.83 s", "1.2 GB", "1.96x", "15%", "354.3 ms"]
    table = "| median of 5, seconds | exit |\n|---|---|\n| `dspark run` | 19.39 |\n"
    assert [f for _, f, _, _ in typed_figures(table)] == ["19.39"]
    assert typed_figures("3x224x224 images, 8 x 32 micro-batches, 2 sockets, step 12\n") == []
    prose = "It took 3 seconds, 12 µs, 2 minutes; 2.1× and 45 per cent more, at 850 samples/s.\n"
    assert [f for _, f, _, _ in typed_figures(prose)] == ["3 seconds", "12 µs", "2 minutes", "2.1×",
                                                          "45 per cent", "850 samples/s"]


def test_an_allowed_entry_explains_only_the_figures_inside_it():
    """An entry is no licence for its line, nor a section entry for its section's prose."""
    line = "min-max** (`1.88x (1.80-1.95)`); DSpark ran 2.3x faster than DDP"
    assert _allowed("docs/bench.md", line, "1.88x", line.index("1.88x"), "") is not None
    assert _allowed("docs/bench.md", line, "2.3x", line.index("2.3x"), "") is None
    section = "## Bounds on what is read"
    row, prose = "| `dspark.json` | 1 MiB, 10,000 values | a few kilobytes |", "Each is read in 12.3 ms."
    assert _allowed("docs/checkpoints.md", row, "1 MiB", row.index("1 MiB"), section) is not None
    assert _allowed("docs/checkpoints.md", prose, "12.3 ms", prose.index("12.3 ms"), section) is None


def test_a_figure_in_a_docstring_or_comment_is_caught_and_code_is_not():
    source = ('"""A module.\n\nIts step took 5.8 ms."""\nLIMIT = 16 * 2**20  # about 16 MiB\n'
              'def f():\n    """Fast: 3.2x the loop."""\n    return "12 ms"  # a value, not prose\n')
    found = [(n, f) for n, line in source_prose(source) for f in _MEASURED.findall(line)]
    assert sorted(found) == [(3, "5.8 ms"), (4, "16 MiB"), (6, "3.2x")]


def test_every_link_to_figures_md_lands_on_an_anchor():
    figures = (ROOT / "docs" / "figures.md").read_text()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', figures))
    texts = {**_doc_texts(), **{str(p.relative_to(ROOT)): p.read_text()
                                for p in sorted((ROOT / "src").rglob("*.py"))}}
    links = [(name, anchor) for name, text in texts.items()
             for anchor in re.findall(r"figures\.md#([a-z0-9][\w.-]*[\w-])", text)]
    assert links, "no doc links to a figures.md section"
    assert [link for link in links if link[1] not in anchors] == []
