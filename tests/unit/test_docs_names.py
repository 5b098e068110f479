"""Names the docs give must exist: every file path, `--flag` and code name (a wire field, a class, a
setting) that README.md or docs/*.md writes in backticks or links to.

What counts as a name is deliberately narrow, so that prose never trips it: only text inside
backticks (or a link target), and only when it looks like a path (has a known file ending or a
slash), a flag (starts with --), or an identifier with an underscore or inner capital
(`forget_seq_ids`, `StepPlan`). Flags, files and names of other programs that the docs quote and
the code never spells are listed here, each once, with the program they belong to."""
from __future__ import annotations

import argparse
import ast
import functools
import os
import re
import subprocess

import pytest

from shared import config as C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# flags of other programs that the docs quote in commands, and the code nowhere (add one here, with
# its program, when a doc quotes it)
FOREIGN_FLAGS = {"--no-binary": "pip"}
# files and names of other programs, or of experiments the history in docs/performance.md describes
FOREIGN_FILES = {"generation_config.json": "a model's folder", "torch/csrc/utils/pybind.h": "torch's source"}
FOREIGN_NAMES = {
    **dict.fromkeys(("avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"), "lscpu"),
    "cgroup_manager": "podman's containers.conf", "events_logger": "podman's containers.conf",
    "cache_prompt": "llama-server's request field", "quant_method": "a GGUF model's config",
    "_paged_attention_cpu": "a measured scratch script", "panel_linear": "a measured scratch build",
}
SELF = "tests/unit/test_docs_names.py"      # its planted names are not the code's
FILE_ENDINGS = ("py", "cpp", "h", "md", "txt", "toml", "yaml", "yml", "json", "sh", "html", "js", "css", "cfg")
_PATH = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")
_FLAG = re.compile(r"^--[a-z][a-z0-9-]*$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def doc_files() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(docs) if f.endswith(".md"))


@functools.cache
def tracked() -> tuple[frozenset[str], frozenset[str]]:
    """Tracked files and their folders, relative to the root; untracked files of this checkout too."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    folders = {os.path.dirname(p) for p in out}
    for p in list(folders):
        while p:
            p = os.path.dirname(p)
            folders.add(p)
    return frozenset(out), frozenset(folders - {""})


def _python_words(source: str) -> list[str]:
    """A Python file's names and string literals, without its comments and docstrings (which may
    still name what is gone)."""
    tree = ast.parse(source)
    docstrings = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body and \
                isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant):
            docstrings.add(id(n.body[0].value))
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.append(n.id)
        elif isinstance(n, ast.Attribute):
            out.append(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(n.name)
        elif isinstance(n, ast.arg):
            out.append(n.arg)
        elif isinstance(n, ast.keyword) and n.arg:
            out.append(n.arg)
        elif isinstance(n, ast.alias):
            out.append(n.asname or n.name)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            out.append(n.value)
    return out


@functools.cache
def code_text() -> str:
    """Every tracked source file a name may live in, as one text (Python without its comments)."""
    files, _ = tracked()
    parts = []
    for p in sorted(files):
        if p == SELF:
            continue
        if p.endswith((".py", ".cpp", ".h", ".toml", ".yaml", ".yml", ".json", ".js", ".html")) or \
                os.path.basename(p) in ("Makefile", "Dockerfile"):
            with open(os.path.join(ROOT, p), encoding="utf-8", errors="replace") as f:
                source = f.read()
            parts.append(" ".join(_python_words(source)) if p.endswith(".py") else source)
    return "\n".join(parts)


@functools.cache
def known_flags() -> frozenset[str]:
    """The flags of every command's parser (generated from shared/config.py) and every flag literal
    in the code (bench scripts, the cli's own)."""
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", code_text()))
    for command in C.COMMANDS:
        parser = argparse.ArgumentParser()
        C.add_settings(parser, command)
        flags.update(s for a in parser._actions for s in a.option_strings)
    return frozenset(flags)


def spans(text: str) -> list[tuple[int, str]]:
    """(line number, text) of each backticked span and each relative link target."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        out.extend((n, m) for m in re.findall(r"`([^`\n]+)`", line))
        out.extend((n, m) for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line) if "://" not in m)
    return out


def words(span: str) -> list[str]:
    """A span may be a command (`pagedserve serve --model M`): each word is checked on its own."""
    return [w.strip(",;:()'\"") for w in span.split()]


def is_path(word: str) -> bool:
    if not _PATH.match(word) or word.startswith(("-", "/")) or word in (".", ".."):
        return False
    return "/" in word or ("." in word and word.rsplit(".", 1)[-1] in FILE_ENDINGS)


def path_exists(word: str, doc: str) -> bool:
    """A path from the root or from the doc's folder; a bare name anywhere (the docs name a file in
    its folder's context); `ops/quantized.find_codes`: a name in that module."""
    files, folders = tracked()
    word = word.rstrip("/")
    if word in FOREIGN_FILES:
        return True
    if "/" not in word:
        return any(os.path.basename(p) == word for p in files) or any(os.path.basename(p) == word for p in folders)
    for base in ("", os.path.dirname(doc)):
        candidate = os.path.normpath(os.path.join(base, word))
        if candidate in files or candidate in folders:
            return True
        module, _, name = candidate.rpartition(".")
        if module + ".py" in files:
            with open(os.path.join(ROOT, module + ".py"), encoding="utf-8") as f:
                return re.search(rf"\b{re.escape(name)}\b", f.read()) is not None
    return False


def is_code_name(word: str) -> bool:
    """An identifier that is surely code: snake_case with an underscore, or CamelCase (an inner
    capital), or a dotted name with such a part (`StepPlan.copies`)."""
    if not _IDENT.match(word):
        return False
    return any(("_" in part.strip("_") and part.lower() == part) or re.match(r"^[A-Z][a-z0-9]+[A-Z]\w*$", part)
               for part in word.split("."))


@functools.cache
def class_members() -> dict[str, set[str]]:
    """Each class defined in the code -> the names it has: fields, methods, attributes set on self."""
    files, _ = tracked()
    members: dict[str, set[str]] = {}
    for p in files:
        if not p.endswith(".py") or p == SELF:
            continue
        with open(os.path.join(ROOT, p), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = members.setdefault(cls.name, set())
            for n in ast.walk(cls):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(n.name)
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    names.add(n.target.id)
                elif isinstance(n, ast.Assign):
                    names.update(t.id for t in n.targets if isinstance(t, ast.Name))
                elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                    names.add(n.attr)
    return members


@functools.cache
def code_words() -> frozenset[str]:
    return frozenset(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code_text()))


def code_name_exists(word: str) -> bool:
    """Each part is a word of the code; `Class.member` needs a class of the code that has the member."""
    parts = word.split(".")
    if len(parts) == 1 and any(p.endswith(f"/{word}.py") for p in tracked()[0]):
        return True              # a module named without its folder and ending (`step_mix`)
    if len(parts) >= 2 and parts[0] in class_members():
        return parts[1] in class_members()[parts[0]]
    return all(part in code_words() for part in parts)


def unknown_names(doc: str, text: str) -> list[str]:
    found = []
    for line, span in spans(text):
        for word in words(span):
            if _FLAG.match(word.split("=", 1)[0]):
                flag = word.split("=", 1)[0]
                if flag not in known_flags() and flag not in FOREIGN_FLAGS:
                    found.append(f"{doc}:{line}: flag {flag}")
            elif is_path(word):
                if not path_exists(word, doc):
                    found.append(f"{doc}:{line}: file {word}")
            elif is_code_name(word) and word not in FOREIGN_NAMES and not code_name_exists(word):
                found.append(f"{doc}:{line}: name {word}")
    return found


@pytest.mark.parametrize("doc", doc_files())
def test_every_name_in_the_docs_exists(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    assert unknown_names(doc, text) == []


@pytest.mark.parametrize("planted, kind", [
    ("`control_plane/plan_builder.py`", "file"), ("[old](../control_plane/replicas.py)", "file"),
    ("`--no-such-flag`", "flag"), ("`pagedserve serve --max-num-seqz 8`", "flag"),
    ("`cont_seqs`", "name"), ("`StepPlan.remaps`", "name"), ("`SchedulerOutput`", "name"),
])
def test_a_wrong_name_is_found(planted, kind):
    found = unknown_names("docs/architecture.md", f"Some prose, then {planted} in a sentence.\n")
    assert len(found) == 1 and f": {kind} " in found[0], found


def test_prose_and_real_names_are_not_flagged():
    text = ("The plan (`StepPlan`) carries `forget_seq_ids` and `cached_seqs`; `--max-num-seqs 8`, "
            "`pip install --no-deps`, [the docs](observability.md), `ops/attention.py`, `block_pool.py`, "
            "`pagedserve_kernels/cpu/`, a `uuid`, `a few words`, `x = 3`, `GET /health`, `e.g.` and `N`.\n")
    assert unknown_names("docs/architecture.md", text) == []
