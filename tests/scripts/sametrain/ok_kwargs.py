"""A correct HF-shaped script: the model is called with keyword arguments
(``model(input=x, labels=y)``) and returns its loss in a dict."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(model="kwargs"))
