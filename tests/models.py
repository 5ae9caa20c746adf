"""A non-transformer NNX model the generic API must handle (the LLaMA-style one ships: minigpt_model.llama)."""

from flax import nnx


class ConvClassifier(nnx.Module):
    """A non-transformer: convolution stages held in a dict, batch norm, an MLP head."""

    def __init__(self, channels=16, classes=8, *, rngs: nnx.Rngs):
        self.stages = nnx.Dict({
            "stem": nnx.Conv(3, channels, (3, 3), rngs=rngs),
            "body": nnx.Conv(channels, 2 * channels, (3, 3), rngs=rngs),
        })
        self.norm = nnx.BatchNorm(2 * channels, use_running_average=True, rngs=rngs)
        self.head = nnx.List([nnx.Linear(2 * channels, 32, rngs=rngs), nnx.Linear(32, classes, rngs=rngs)])

    def __call__(self, images, **_):
        x = nnx.relu(self.stages["stem"](images))
        x = self.norm(nnx.relu(self.stages["body"](x)))
        x = x.mean(axis=(1, 2))
        return self.head[1](nnx.relu(self.head[0](x)))
