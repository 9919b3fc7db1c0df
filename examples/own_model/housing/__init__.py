"""A user's package, as gradsync train finds it: models.py and data.py, importable from this folder."""
