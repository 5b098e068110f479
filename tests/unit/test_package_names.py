"""pagedserve's top-level packages must not share a name with another installed distribution's.

transformers 5.25 came to require Hugging Face's `kernels` distribution; this project's package was also
called `kernels`, so `import kernels` found ours and transformers failed at import. The check below reads
which distributions provide each import name, so a clash with anything installed shows up here first.
"""
import importlib.metadata
import importlib.util
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def top_level_packages() -> list[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    return [p.rstrip("*") for p in patterns]


def test_no_other_installed_distribution_provides_one_of_our_packages():
    providers = importlib.metadata.packages_distributions()
    names = top_level_packages()
    assert "pagedserve_kernels" in names
    clashes = {name: others for name in names
               if (others := sorted(set(providers.get(name, [])) - {"pagedserve"}))}
    assert clashes == {}, f"installed distributions that provide the same import names: {clashes}"


def test_each_of_our_packages_imports_from_this_checkout():
    for name in top_level_packages():
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        assert os.path.dirname(os.path.dirname(spec.origin)) == ROOT, (name, spec.origin)
