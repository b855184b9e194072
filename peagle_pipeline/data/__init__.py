"""Chat data: reading dataset files (`formats`) and rendering conversations to tokens and loss masks (`chat`)."""
