"""The collectives the tests know, by the traffic they carry: host metadata (over the gloo
side groups) and device tensors (over the device groups). A name missing from both is a
collective no test has looked at."""

HOST_TRAFFIC = ("batch.shapes", "batch.tokens", "zebra.header", "zebra.answer_header", "zebra.balance", "ep.counts",
                "monitor.counts", "monitor.busy", "strategy.emulation_report", "strategy.shutdown",
                "strategy.checkpoint.mkdir", "strategy.checkpoint.sees", "strategy.memory_report", "strategy.callback_metrics", "batch.counts",
                "zebra.eval", "strategy.batches", "zebra.train_outputs", "lightning.sigterm", "lightning.sigterm.agree",
                "batch.gather.host", "strategy.broadcast", "strategy.barrier", "strategy.decision",
                "cluster.devices", "profile.devices", "experts.optimizer_keys", "strategy.warmup.shape")
DEVICE_TRAFFIC = ("zebra.rows", "zebra.answers", "zebra.loss", "zebra.clip", "zebra.grads.dense",
                  "zebra.grads.replicas", "zebra.weights", "ep.rows", "ep.balance", "ep.clip", "strategy.weights",
                  "ep.grads.copies", "ep.grads.replicas", "experts.gather", "batch.gather",
                  "zero.params", "zero.clip", "zebra.outputs", "zebra.metrics", "averaging.dense", "strategy.warmup")
