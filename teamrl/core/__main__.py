"""``python -m teamrl.core`` prints the config reference table (Markdown; docs/config.md holds it)."""

from teamrl.core.schema_doc import schema_table

print(schema_table(), end="")
