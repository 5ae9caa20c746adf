"""A non-transformer NNX model the generic API must handle (the LLaMA-style one ships: minigpt_model.llama)."""

from flax import nnx


class ConvClassifier(nnx.Module):
    """A non-transformer: convolution stages held in a dict, batch norm, an MLP head."""

    def __init__(self, channels=16, classes=8, *, rngs: nnx.Rngs):
        self.stages = nnx.Dict(
            {
                "stem": nnx.Conv(3, channels, (3, 3), rngs=rngs),
                "body": nnx.Conv(channels, 2 * channels, (3, 3), rngs=rngs),
            }
        )
        self.norm = nnx.BatchNorm(2 * channels, use_running_average=True, rngs=rngs)
        self.head = nnx.List([nnx.Linear(2 * channels, 32, rngs=rngs), nnx.Linear(32, classes, rngs=rngs)])

    def __call__(self, images, **_):
        x = nnx.relu(self.stages["stem"](images))
        x = self.norm(nnx.relu(self.stages["body"](x)))
        x = x.mean(axis=(1, 2))
        return self.head[1](nnx.relu(self.head[0](x)))


class PositionedBlock(nnx.Module):
    def __init__(self, dim, heads, hidden, *, rngs):
        self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False, rngs=rngs)
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class PositionedDecoder(nnx.Module):
    """A decoder on `nnx.MultiHeadAttention` that takes its positions from its caller (learned position
    embeddings looked up by them, the causal mask built from them), as long-context training feeds
    them: such a model may be given its sequence in any order."""

    def __init__(self, vocab=64, dim=32, heads=4, hidden=64, layers=2, maxlen=64, *, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(vocab, dim, rngs=rngs)
        self.places = nnx.Embed(maxlen, dim, rngs=rngs)
        self.layers = nnx.List([PositionedBlock(dim, heads, hidden, rngs=rngs) for _ in range(layers)])
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens, positions):
        mask = positions[:, None, :, None] >= positions[:, None, None, :]  # (B, 1, T, T)
        x = self.tokens(tokens) + self.places(positions)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


class SlowToTrace(nnx.Module):
    """A small language model whose forward on a batch of more than one sequence takes `seconds` each time
    it runs in Python (every trace): a candidate of `auto --measure` that hangs as far as its time limit
    is concerned (the planner's own trace, of one sequence, does not wait)."""

    def __init__(self, vocab=64, dim=32, seconds=120.0, *, rngs: nnx.Rngs):
        self.seconds = seconds
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens):
        import time

        if tokens.shape[0] > 1:
            time.sleep(self.seconds)
        return self.head(self.embed(tokens))
