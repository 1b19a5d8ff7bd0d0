from anima_ui.cli import main

raise SystemExit(main())
