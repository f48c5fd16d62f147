"""What both `data` and `model` (and `training`) use, importing neither: name registries and
temp-then-rename file writing (files.py)."""
