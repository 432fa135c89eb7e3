"""A built output's finishing and what works on a finished one: its model card, shipped
modeling code and checks (a build's last stage), and the commands that change a finished
output: `bake` (curvature folded into the experts), `extend`, `extract` and GGUF."""
