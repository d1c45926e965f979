"""What the README and docs/ show is what the code does: every relative link resolves, and every example runs.

The fences are the contract (docs/development.md, *Examples in the docs*):

- ```` ```python ```` runs, in order, in one fresh Jupyter kernel per page, as a notebook's cells would;
  ```` ```python fresh ```` starts a new kernel for itself and the blocks after it.
- ```` ```text ```` right after a ```` ```python ```` block is what that block printed: everything it wrote, its
  value and its error, compared line by line; ``…`` stands for any text within a line, and a line that is ``…``
  alone for any lines.
- ```` ```python no-run ```` is shown and not run: only where running needs what the suite does not have (a SLURM
  cluster of several nodes, a GPU, a file in the IPython profile).
- ```` ```bash ```` is a terminal: a block of ``python -m vgpu_magic`` lines runs (in the kernel's environment,
  with its output compared as above); any other is set-up on a fresh machine (``make``, ``pip install``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import ROOT, kernel_errors, kernel_run, started_kernel

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)|\b(?:src|srcset)=\"([^\"\s]+)\"")
_PICTURE = re.compile(r"<picture>(.*?)</picture>", re.DOTALL)


@dataclass
class Block:
    page: Path
    line: int
    end: int
    info: str
    code: str

    @property
    def words(self) -> list[str]:
        return self.info.split()


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, m.start()) + 1, text.count("\n", 0, m.end()) + 1, m[1].strip(), m[2])
        for m in _FENCE.finditer(text)
    ]


def _outside_fences(text: str) -> str:
    return _FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces as dashes."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", _outside_fences(page.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def relative_links(page: Path) -> list[str]:
    targets = [md or html for md, html in _LINK.findall(_outside_fences(page.read_text()))]
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        name = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {name}")
    return broken


def test_each_readme_image_has_its_dark_theme_version():
    """GitHub serves a <picture>'s dark <source> to its dark theme: no light screenshot as a white slab there."""
    text = _outside_fences((ROOT / "README.md").read_text())
    lights = re.findall(r"docs/images/\w+_light\.png", text)
    pictures = _PICTURE.findall(text)
    assert lights and len(pictures) == len(lights)
    for picture, light in zip(pictures, lights):
        dark = light.replace("_light.png", "_dark.png")
        assert f'<source media="(prefers-color-scheme: dark)" srcset="{dark}">' in picture
        assert f'src="{light}"' in picture and "alt=" in picture


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page)


def test_a_missing_file_or_heading_is_a_broken_link(tmp_path):
    (tmp_path / "other.md").write_text("# Its Heading: `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#its-heading-code) [here](#a-b) [gone](gone.md) [no heading](other.md#nothing) "
        "[web](https://example.org/x.md)\n## A, b\n```text\n[in a fence](fenced.md)\n```\n"
        '<picture><source srcset="dark.png"><img src="other.md"></picture>\n'
    )
    assert broken_links(page) == [
        "gone.md: no such file",
        f"other.md#nothing: no heading #nothing in {tmp_path}/other.md",
        "dark.png: no such file",
    ]


def test_every_fence_says_what_it_is():
    """A block is run, is output, is set-up, or is said not to run: nothing is left unclear."""
    known = {("python",), ("python", "fresh"), ("python", "no-run"), ("text",), ("bash",)}
    unclear = [f"{b.page.name}:{b.line} ```{b.info}" for p in PAGES for b in blocks(p) if tuple(b.words) not in known]
    assert not unclear, unclear


def test_the_pages_exist_and_the_readme_fits_on_a_screen():
    assert {p.name for p in PAGES} >= {"README.md", "split.md", "live-view.md", "ranks.md", "estimates.md"}
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160


def output_of(messages: list[dict]) -> str:
    """What a cell showed, as text: its streams, displays and value in order, then its error."""
    parts = []
    for m in messages:
        kind, content = m["msg_type"], m["content"]
        if kind == "stream":
            parts.append(content["text"])
        elif kind in ("display_data", "update_display_data", "execute_result") and "text/plain" in content["data"]:
            parts.append(content["data"]["text/plain"] + "\n")
    parts += [f"{e}\n" for e in kernel_errors(messages)]
    return "".join(parts).replace("\r\n", "\n")  # a shell command's output comes through a terminal


def _pattern(expected: str) -> re.Pattern:
    lines = []
    for line in expected.rstrip("\n").splitlines():
        if line.strip() == "…":
            lines.append(r"(?:[^\n]*\n)*?")
        else:
            lines.append("[^\n]*".join(re.escape(part) for part in line.rstrip().split("…")) + r"[ \t]*\n")
    return re.compile("".join(lines))


_RANK_LINE = re.compile(r"\[rank (\d+)\] ")


def in_rank_order(text: str) -> str:
    """``text`` with each run of consecutive ``[rank N]`` lines in rank order, each rank's own lines in their order:
    ranks print at the same time, so their lines interleave as they arrive (as on torchrun's terminal)."""
    lines, run = [], []
    for line in text.splitlines(keepends=True):
        if found := _RANK_LINE.match(line):
            run.append((int(found[1]), line))
            continue
        lines += [ranked for _, ranked in sorted(run, key=lambda pair: pair[0])] + [line]
        run = []
    return "".join(lines + [ranked for _, ranked in sorted(run, key=lambda pair: pair[0])])


def matches(expected: str, shown: str) -> bool:
    return _pattern(in_rank_order(expected)).fullmatch(in_rank_order(shown.rstrip("\n") + "\n")) is not None


def test_every_notebook_is_in_the_readmes_table_and_the_quickstarts_next_list():
    """A new user finds the notebooks from the README and from the quickstart's last cell (13 was missing there)."""
    import json

    readme = (ROOT / "README.md").read_text()
    quickstart = json.loads((ROOT / "notebooks" / "01_quickstart.ipynb").read_text())
    last = "".join(quickstart["cells"][-1]["source"])
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"(notebooks/{notebook.name})" in readme, notebook.name
        assert notebook.name == "01_quickstart.ipynb" or f"`{notebook.name}`" in last, notebook.name


def test_the_output_pattern_reads_ellipses_as_the_docs_mean_them():
    assert matches("a … c\n", "a b b c\n")
    assert matches("first\n…\nlast\n", "first\none\ntwo\nlast\n")
    assert matches("first\n…\nlast\n", "first\nlast\n")
    assert not matches("a … c\n", "a b\nc\n")
    assert not matches("first\nlast\n", "first\nmiddle\nlast\n")
    # Ranks print at once: their lines may arrive interleaved, each rank's own still in order.
    assert matches("[rank 0] a\n[rank 0] b\n[rank 1] c\ndone\n", "[rank 1] c\n[rank 0] a\n[rank 0] b\ndone\n")
    assert not matches("[rank 0] a\n[rank 0] b\n", "[rank 0] b\n[rank 0] a\n")


def runs(page: Path) -> list[list[tuple[Block, Block | None]]]:
    """The page's runnable blocks with the output shown after each, grouped by kernel."""
    found = blocks(page)
    lines = page.read_text().splitlines()
    groups: list[list[tuple[Block, Block | None]]] = []
    for i, block in enumerate(found):
        if not (block.words[:1] == ["python"] and "no-run" not in block.words) and not _cli(block):
            continue
        after = found[i + 1] if i + 1 < len(found) else None
        next_to = after is not None and not "".join(lines[block.end : after.line - 1]).strip()
        shown = after if next_to and after.info == "text" else None
        if "fresh" in block.words or not groups:
            groups.append([])
        groups[-1].append((block, shown))
    return groups


def _cli(block: Block) -> bool:
    lines = [line for line in block.code.splitlines() if line.strip()]
    return block.info == "bash" and bool(lines) and all(line.startswith("python -m vgpu_magic ") for line in lines)


def as_cell(block: Block) -> str:
    """The block as a notebook cell: the command line's lines through the kernel's own interpreter."""
    if not _cli(block):
        return block.code
    lines = [line.removeprefix("python ") for line in block.code.splitlines() if line.strip()]
    return "import sys\n" + "".join(f"!{{sys.executable}} {line}\n" for line in lines)


def quietly(kc, code: str) -> None:
    """Run ``code`` without counting it in the kernel's history: the pages' ``In [N]`` are their own blocks."""
    msg_id = kc.execute(code, store_history=False)
    while not (
        (msg := kc.get_iopub_msg(timeout=120))["parent_header"].get("msg_id") == msg_id
        and msg["msg_type"] == "status"
        and msg["content"]["execution_state"] == "idle"
    ):
        pass


RUNNABLE = [p for p in PAGES if runs(p)]


def test_blocks_pair_with_the_output_right_after_them_and_fresh_starts_a_kernel(tmp_path):
    page = tmp_path / "page.md"
    fence = "```"
    page.write_text(
        f"{fence}python\na = 1\n{fence}\n\n{fence}text\n1\n{fence}\n"
        f"{fence}python no-run\nslurm()\n{fence}\n{fence}text\nnot checked\n{fence}\n"
        f"{fence}python fresh\nb = 2\n{fence}\nprose between\n{fence}text\nnot its output\n{fence}\n"
        f"{fence}bash\npython -m vgpu_magic status\n{fence}\n{fence}bash\nmake lab\n{fence}\n"
    )
    paired = [[(block.code, shown and shown.code) for block, shown in group] for group in runs(page)]
    assert paired == [[("a = 1\n", "1\n")], [("b = 2\n", None), ("python -m vgpu_magic status\n", None)]]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_output_a_page_shows_is_checked(page):
    """A ```text block is the output of the run block right before it, so the run compares it: none is left over."""
    checked = {shown.line for group in runs(page) for _, shown in group if shown is not None}
    unchecked = [b.line for b in blocks(page) if b.info == "text" and b.line not in checked]
    assert not unchecked, f"{page.name}: output blocks that follow no run block, at lines {unchecked}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("no_process_left_behind")
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_runs_and_shows_what_the_page_says(page, tmp_path):
    wrong = []
    for group in runs(page):
        with started_kernel() as (_, kc):
            quietly(kc, f"%cd -q {tmp_path}")
            for block, shown in group:
                messages = kernel_run(kc, as_cell(block), timeout=600)
                text = output_of(messages)
                where = f"{page.name}:{block.line}"
                if shown is not None and not matches(shown.code, text):
                    wrong.append(f"{where} shows:\n{shown.code}--- but printed:\n{text}")
                elif shown is None and kernel_errors(messages):
                    wrong.append(f"{where} raised:\n{text}")
            quietly(kc, "%unload_ext vgpu_magic")
    assert not wrong, "\n\n".join(wrong)
