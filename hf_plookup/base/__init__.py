"""What every layer of the package may use: a step's arrays (`layout`), where inputs go (`device`),
argument checks (`checks`) and attention over dense tensors, the reference every backend is checked
against (`dense`)."""
