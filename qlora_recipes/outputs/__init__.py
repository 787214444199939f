"""What a finished run gives: reading its run dir back, prompts in its training format, generation."""
