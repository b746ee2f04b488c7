"""Loading into and saving from models that are not transformers' own classes.

Each module here is one framework's adapter: the mapping from its parameter names and layouts to a
Hugging Face checkpoint's, and one call each way; the planners underneath are the same.
"""
