from torchkiln.cli import main

raise SystemExit(main())
