"""``python -m teamrl.core`` prints the config reference table (Markdown) for the README."""

from teamrl.core.config import describe_schema

print("| key | type | default | meaning |\n|---|---|---|---|")
for key, tp, default, doc in describe_schema():
    print(f"| `{key}` | {tp} | `{default}` | {doc} |" if default else f"| `{key}` | {tp} | | {doc} |")
