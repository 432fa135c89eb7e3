"""A usage mistake is said at once, before the second or two that importing torch takes:
every command checks its arguments and options (and the output rule) before it imports torch.
"""

import json
import subprocess
import sys

# each: the arguments, and a phrase of the error they get
MISTAKES = [
    (["build", "{recipe}"], "OUTPUT: missing"),
    (["build", "{recipe}", "{tmp}/out", "--workers", "0"], "--workers"),
    (["build", "{recipe}", "{tmp}/out", "--verify", "sometimes"], "verify"),
    (["build", "{recipe}", "{tmp}/out", "--tune-on", "{recipe}", "--tune-lambdas", "x"],
     "comma-separated numbers"),
    (["shrink", "{tmp}", "{tmp}/out", "--calibration", "{recipe}", "--experts", "1",
      "--method", "chop"], "method"),
    (["shrink", "{tmp}/nowhere", "{tmp}/out", "--calibration", "{recipe}", "--experts", "1"],
     "no such directory"),
    (["inspect", "task-vectors", "{tmp}"], "at least one EXPERT"),
    (["inspect", "routing", "{tmp}", "--data", "{recipe}", "--seq-len", "99999999"],
     "--seq-len"),
    (["route", "{tmp}", "{recipe}", "--split", "sentence"], "--split"),
    # the output rule: OUTPUT inside the input model
    (["extend", "{tmp}", "{recipe}", "--expert", "{tmp}"], "never writes into"),
    (["extract", "{tmp}", "{recipe}", "--expert", "0"], "never writes into"),
    (["bake", "{tmp}", "{recipe}"], "never writes into"),
]

SCRIPT = """
import json, sys
from typer.testing import CliRunner
from moemerge.cli import app
said = []
for args, _ in json.loads(sys.argv[1]):
    result = CliRunner().invoke(app, args)
    said.append([result.exit_code, " ".join(result.output.split()), "torch" in sys.modules])
print(json.dumps(said))
"""


def test_usage_errors_come_before_torch_is_imported(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("kind: merge\n")
    cases = [([a.format(recipe=recipe, tmp=tmp_path) for a in args], phrase)
             for args, phrase in MISTAKES]
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for (args, phrase), (code, output, torch) in zip(cases, json.loads(done.stdout),
                                                     strict=True):
        assert code in (1, 2) and phrase in output, (args, code, output)
        assert not torch, f"moemerge {' '.join(args)}: torch imported before {output!r}"
