"""EasyLM-style partition rules for a GPT: (regex, PartitionSpec) pairs matched with re.search, first
match wins. `shardplan convert docs/examples/partition_rules.py --mesh dp=4,mp=2 -o plan.yaml` reads
them with `ast` (this file is never imported or run) and writes an equivalent plan."""

from jax.sharding import PartitionSpec as PS


def get_partition_rules():
    return (
        ("token_emb/embedding", PS("mp", None)),
        ("pos_emb/embedding", PS()),
        ("mha/(query|key|value)/kernel", PS(None, "mp", None)),
        ("mha/out/kernel", PS("mp", None, None)),
        ("linear1/kernel", PS(None, "mp")),
        ("linear2/kernel", PS("mp", None)),
        ("output_layer/kernel", PS(None, "mp")),
        (".*", PS()),
    )
