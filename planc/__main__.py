from planc.commands.cli import main

raise SystemExit(main())
