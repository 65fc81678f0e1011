from batchgen.syspath import drop_checkouts

drop_checkouts()  # before anything imports transformers: see syspath.py

from batchgen.cli import main  # noqa: E402

main()
