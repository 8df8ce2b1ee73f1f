"""What the tests load or launch: plugins, fixtures, helper programs."""
