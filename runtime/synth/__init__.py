"""zipmoe.runtime.synth: synthetic checkpoints of every supported family, and the demo model."""
