"""Configuration: the flag table's machinery, the table itself with its rules and the
validated ``Config``, and endpoint parsing (pure; imports nothing else of the product).
"""
