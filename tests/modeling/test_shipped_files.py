"""The modeling files copied next to the weights load through any transformers' remote-code
loader: transformers 4 copies a module's own relative imports into its module cache, not the
imports of those, so every shipped module must import each neighbour it needs itself."""

import re
from importlib import resources

from moemerge.architectures.config import AUTO_MAP, MERGED_AUTO_MAP
from moemerge.finish.remote_code import MODELING_FILES

RELATIVE = re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE)


def relative_imports(name: str) -> set[str]:
    text = resources.files("moemerge.modeling").joinpath(name).read_text()
    return {f"{module}.py" for module in RELATIVE.findall(text)}


def test_every_needed_file_is_shipped_and_imported_directly():
    for auto_map in (AUTO_MAP, MERGED_AUTO_MAP):
        for reference in auto_map.values():
            entry = reference.split(".")[0] + ".py"
            assert entry in MODELING_FILES
            direct, seen, todo = relative_imports(entry), set(), [entry]
            while todo:  # everything the entry needs, transitively
                module = todo.pop()
                seen.add(module)
                todo += [m for m in relative_imports(module) if m not in seen]
            assert seen - {entry} <= direct, (entry, seen - {entry} - direct)
            assert seen <= set(MODELING_FILES)
