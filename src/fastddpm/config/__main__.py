"""python -m fastddpm.config > docs/config.md"""

from fastddpm.config.reference import reference_markdown

print(reference_markdown(), end="")
