"""The docs' "add a loss" snippet, as a user who pasted it at the end of losses.py would run it.

    python tests/loss_snippet_run.py --loss.loss-type reinforce [grpo.py flags]    # grpo.py with the snippet in
"""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_a_loss_snippet():
    """The first python code block in the docs that registers LOSSES["reinforce"] (wherever the docs put it)."""
    for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]:
        for block in re.findall(r"```python\n(.*?)```", open(path).read(), re.S):
            if 'LOSSES["reinforce"]' in block:
                return block
    raise AssertionError("no docs code block registers LOSSES[\"reinforce\"]: the add-a-loss snippet is gone")


def paste_into(losses):
    exec(add_a_loss_snippet(), vars(losses))  # as if written at the end of losses.py


if __name__ == "__main__":
    import tyro

    import console
    import grpo
    import losses
    paste_into(losses)
    console.run_script(grpo.main, tyro.cli(grpo.Config))
